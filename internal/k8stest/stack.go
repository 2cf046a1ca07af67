package k8stest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/restmapper"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/client"
	storpki "github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// Namespace is deploy/'s namespace.
const Namespace = "stor-system"

// NodeSpec is one node of the stack: a fake kubelet, a node plugin and a
// stor server (Server false: no server on that node).
type NodeSpec struct {
	Name   string
	Zone   string
	Server bool
}

// Options configure Start.
type Options struct {
	// Bin is the directory of the Kubernetes binaries (scripts/k8s-tools.sh
	// prints its parent; its manifests/ directory holds the snapshot CRDs).
	Bin string
	// StorCSI is the stor-csi binary.
	StorCSI string
	// Manifests are deploy/'s base, rendered (one object per document).
	Manifests [][]byte
	Nodes     []NodeSpec
}

// Stack is the whole of it: control plane, stor, deploy/ applied, the
// controller pods' processes, the nodes.
type Stack struct {
	t       testing.TB
	opts    Options
	dir     string
	CP      *ControlPlane
	Stor    *servertest.Cluster
	storCSI csi.Cluster
	Nodes   map[string]*Node
	// Controllers are the processes of each csi-controller pod, by pod name.
	Controllers map[string]*ControllerPod
	log         *slog.Logger
	mapper      meta.RESTMapper
	serverNode  map[string]string // stor server id -> its Kubernetes node
}

// ServerNode is the Kubernetes node of stor server id.
func (s *Stack) ServerNode(id string) string { return s.serverNode[id] }

// Node is one fake node: its kubelet and node plugin.
type Node struct {
	Spec    NodeSpec
	Kubelet *Kubelet
	Plugin  *NodePlugin
}

// ControllerPod is one pod of deploy/'s csi-controller Deployment, run as
// processes: stor-csi and each sidecar, by container name.
type ControllerPod struct {
	Pod    *corev1.Pod
	Procs  map[string]*proc
	killed []*proc // killed by Kill, for the logs
	dir    string
}

// Start brings the whole stack up; everything stops in t.Cleanup.
func Start(t testing.TB, opts Options) *Stack {
	t.Helper()
	dir := t.TempDir()
	s := &Stack{t: t, opts: opts, dir: dir, Nodes: map[string]*Node{}, Controllers: map[string]*ControllerPod{}, serverNode: map[string]string{},
		log: slog.New(slog.NewTextHandler(&testWriter{t: t}, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if err := os.MkdirAll(filepath.Join(dir, "cp"), 0o700); err != nil {
		t.Fatal(err)
	}
	s.CP = StartControlPlane(t, filepath.Join(opts.Bin, "bin"), filepath.Join(dir, "cp"))
	s.refreshMapper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()

	// The snapshot CRDs and the snapshot-controller, as a cluster that
	// supports snapshots has them (deploy/'s stated prerequisite).
	crds, err := filepath.Glob(filepath.Join(opts.Bin, "manifests", "snapshot.storage.k8s.io_*.yaml"))
	if err != nil || len(crds) != 3 {
		t.Fatalf("k8stest: snapshot CRDs in %s: %v %v", opts.Bin, crds, err)
	}
	for _, f := range append(crds, filepath.Join(opts.Bin, "manifests", "rbac-snapshot-controller.yaml")) {
		s.ApplyFile(ctx, f)
	}
	s.waitCRDs(ctx, "volumesnapshots.snapshot.storage.k8s.io", "volumesnapshotcontents.snapshot.storage.k8s.io", "volumesnapshotclasses.snapshot.storage.k8s.io")

	// stor: one server per node that has one, told its Kubernetes node.
	var serverNodes []NodeSpec
	for _, n := range opts.Nodes {
		if n.Server {
			serverNodes = append(serverNodes, n)
		}
	}
	reviewer := &lazyReviewer{s: s}
	s.Stor = servertest.NewCluster(t, servertest.Options{Servers: len(serverNodes), TLS: true, NodeIssuer: true, Configure: func(i int, cfg *server.Config) {
		cfg.NodeCerts.Reviewer, cfg.NodeCerts.ServiceAccount = reviewer, nodeServiceAccount
		cfg.KubernetesNode, cfg.Zone = serverNodes[i].Name, serverNodes[i].Zone
		s.serverNode[cfg.ID] = cfg.KubernetesNode
		cfg.Logger = s.log.With("server", cfg.ID)
	}})
	var addrs []string
	for _, n := range s.Stor.Nodes {
		addrs = append(addrs, n.Addr)
	}
	// The test's own view of stor, as the operator.
	cl, err := client.Dial(addrs, s.Stor.TLSSource(servertest.Operator).GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	s.storCSI = csi.Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots}

	// deploy/ as rendered, its certificates issued by the stand-in for
	// cert-manager (certmanager.go) from the stor cluster's CA.
	for _, doc := range certManagerCRDs() {
		s.Apply(ctx, doc)
	}
	s.waitCRDs(ctx, "issuers.cert-manager.io", "certificates.cert-manager.io")
	for _, doc := range opts.Manifests {
		s.Apply(ctx, doc)
	}
	s.issueCertificates(ctx)
	for _, n := range opts.Nodes {
		s.AddNode(n)
	}
	s.startSnapshotController(ctx)
	s.startControllers(ctx)
	return s
}

// ServerAddrs are the stor servers' control addresses, comma-separated.
func (s *Stack) ServerAddrs() string {
	var addrs []string
	for _, n := range s.Stor.Nodes {
		addrs = append(addrs, n.Addr)
	}
	return strings.Join(addrs, ",")
}

// AddNode starts a node plugin and a fake kubelet for n (its server, if
// any, is started by Start).
func (s *Stack) AddNode(n NodeSpec) *Node {
	s.t.Helper()
	dir := filepath.Join(s.dir, "nodes", n.Name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		s.t.Fatal(err)
	}
	// The node plugin speaks to stor as csi-node/<node> (what it may
	// attach and open is what ControllerPublish attached to its node),
	// with a certificate it obtains as deploy/'s pod does (nodecerts.go)
	// once the node is registered and its DaemonSet pod exists.
	var np *NodePlugin
	registered := func(ctx context.Context) error {
		src, err := s.nodeCredentials(ctx, n.Name, dir)
		if err != nil {
			return fmt.Errorf("node plugin certificate: %w", err)
		}
		cl, err := client.Dial(strings.Split(s.ServerAddrs(), ","), src.GRPCDialCredentials())
		if err != nil {
			return err
		}
		s.t.Cleanup(func() { cl.Close() })
		np = StartNodePlugin(s.t, dir, n.Name, n.Zone, csi.Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots},
			src.Dialer(nil, storpki.RoleServer), s.log.With("node", n.Name))
		return nil
	}
	kl := StartKubelet(s.t, KubeletConfig{Name: n.Name, Zone: n.Zone, Driver: "unix://" + filepath.Join(dir, "csi.sock"), Root: filepath.Join(dir, "kubelet"),
		Client: s.CP.NodeConfig(n.Name), Logger: s.log, Registered: registered})
	node := &Node{Spec: n, Kubelet: kl, Plugin: np}
	s.Nodes[n.Name] = node
	return node
}

func (s *Stack) refreshMapper() {
	dc := memory.NewMemCacheClient(s.CP.Client.Discovery())
	s.mapper = restmapper.NewDeferredDiscoveryRESTMapper(dc)
}

// ApplyFile applies every object of a YAML file.
func (s *Stack) ApplyFile(ctx context.Context, path string) {
	s.t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		s.t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(doc)) > 0 && !isComment(doc) {
			s.Apply(ctx, doc)
		}
	}
}

func isComment(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") && l != "---" {
			return false
		}
	}
	return true
}

// Apply applies one object (YAML or JSON) with server-side apply, as
// kubectl apply --server-side does, and returns it.
func (s *Stack) Apply(ctx context.Context, doc []byte) *unstructured.Unstructured {
	s.t.Helper()
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		s.t.Fatalf("k8stest: apply: %v", err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(js); err != nil {
		s.t.Fatalf("k8stest: apply: %v\n%s", err, doc)
	}
	gvk := obj.GroupVersionKind()
	var out *unstructured.Unstructured
	err = poll(ctx, func() error {
		m, err := s.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			s.refreshMapper()
			return err
		}
		ri := s.CP.Dynamic.Resource(m.Resource)
		var r interface {
			Patch(context.Context, string, types.PatchType, []byte, metav1.PatchOptions, ...string) (*unstructured.Unstructured, error)
		} = ri
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ns := obj.GetNamespace()
			if ns == "" {
				ns = "default"
			}
			r = ri.Namespace(ns)
		}
		out, err = r.Patch(ctx, obj.GetName(), types.ApplyPatchType, js, metav1.PatchOptions{FieldManager: "k8stest", Force: ptr.To(true)})
		return err
	})
	if err != nil {
		s.t.Fatalf("k8stest: apply %s %s/%s: %v", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
	}
	return out
}

func (s *Stack) waitCRDs(ctx context.Context, names ...string) {
	s.t.Helper()
	crd := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for _, name := range names {
		err := poll(ctx, func() error {
			o, err := s.CP.Dynamic.Resource(crd).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
			for _, c := range conds {
				m, _ := c.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					return nil
				}
			}
			return fmt.Errorf("CRD %s not established", name)
		})
		if err != nil {
			s.t.Fatal(err)
		}
	}
	s.refreshMapper()
}

// Token is a token of a ServiceAccount (bound to pod, if not nil), as
// the kubelet projects into a pod.
func (s *Stack) Token(ctx context.Context, ns, sa string, pod *corev1.Pod) string {
	s.t.Helper()
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	var tok string
	err := poll(ctx, func() error {
		r, err := s.CP.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, req, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		tok = r.Status.Token
		return nil
	})
	if err != nil {
		s.t.Fatalf("k8stest: token for %s/%s: %v", ns, sa, err)
	}
	return tok
}

func (s *Stack) startSnapshotController(ctx context.Context) {
	s.t.Helper()
	kc := s.CP.TokenKubeconfig("snapshot-controller", s.Token(ctx, "kube-system", "snapshot-controller", nil))
	p, err := startProc(s.dir, "snapshot-controller", filepath.Join(s.opts.Bin, "bin", "snapshot-controller"),
		[]string{"--kubeconfig=" + kc, "--leader-election=false", "--v=2"}, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { s.dumpOnFailure(p); p.stop(syscall.SIGTERM) })
}

// sidecarBinaries maps deploy/'s controller containers to binaries in
// Bin; stor-csi is Options.StorCSI. The livenessprobe sidecar cannot be
// fetched as a Go module: it is not run (the probe it serves is CSI Probe,
// which csi's own tests cover).
var sidecarBinaries = map[string]string{
	"csi-provisioner": "csi-provisioner", "csi-attacher": "csi-attacher",
	"csi-resizer": "csi-resizer", "csi-snapshotter": "csi-snapshotter",
}

// startControllers waits for the csi-controller Deployment's pods to run
// on the fake nodes and starts each pod's processes.
func (s *Stack) startControllers(ctx context.Context) {
	s.t.Helper()
	var pods []corev1.Pod
	err := poll(ctx, func() error {
		l, err := s.CP.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=stor-csi-controller"})
		if err != nil {
			return err
		}
		pods = pods[:0]
		for _, p := range l.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				pods = append(pods, p)
			}
		}
		if len(pods) < 2 {
			return fmt.Errorf("%d of 2 csi-controller pods running", len(pods))
		}
		return nil
	})
	if err != nil {
		s.t.Fatalf("k8stest: %v", err)
	}
	for i := range pods {
		s.StartControllerPod(ctx, &pods[i])
	}
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// StartControllerPod runs pod's containers as processes, with the
// arguments its spec gives (see the package doc for what is rewritten).
func (s *Stack) StartControllerPod(ctx context.Context, pod *corev1.Pod) *ControllerPod {
	s.t.Helper()
	dir, err := os.MkdirTemp(s.dir, "ctrl-")
	if err != nil {
		s.t.Fatal(err)
	}
	cp := &ControllerPod{Pod: pod, Procs: map[string]*proc{}, dir: dir}
	kubeconfig := s.CP.TokenKubeconfig("sa-"+pod.Name, s.Token(ctx, pod.Namespace, pod.Spec.ServiceAccountName, pod))
	for _, c := range pod.Spec.Containers {
		bin := sidecarBinaries[c.Name]
		switch {
		case c.Name == "stor-csi":
			bin = s.opts.StorCSI
		case bin != "":
			bin = filepath.Join(s.opts.Bin, "bin", bin)
		default:
			continue
		}
		env := map[string]string{}
		for _, e := range c.Env {
			switch {
			case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil:
				switch e.ValueFrom.FieldRef.FieldPath {
				case "metadata.namespace":
					env[e.Name] = pod.Namespace
				case "metadata.name":
					env[e.Name] = pod.Name
				case "spec.nodeName":
					env[e.Name] = pod.Spec.NodeName
				default:
					s.t.Fatalf("k8stest: container %s: env %s from %s not supported", c.Name, e.Name, e.ValueFrom.FieldRef.FieldPath)
				}
			case e.ValueFrom == nil:
				env[e.Name] = e.Value
			}
		}
		// Secret volumes (the certificates of tls.yaml): the Secret's keys
		// as files in a directory of this pod, named where it is mounted.
		mounts := map[string]string{} // mountPath -> local dir
		for _, m := range c.VolumeMounts {
			i := slices.IndexFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
			if i < 0 || pod.Spec.Volumes[i].Secret == nil {
				continue
			}
			sec, err := s.CP.Client.CoreV1().Secrets(pod.Namespace).Get(ctx, pod.Spec.Volumes[i].Secret.SecretName, metav1.GetOptions{})
			if err != nil {
				s.t.Fatalf("k8stest: pod %s: secret volume %s: %v", pod.Name, m.Name, err)
			}
			local := filepath.Join(dir, "secret-"+m.Name)
			if err := os.MkdirAll(local, 0o700); err != nil {
				s.t.Fatal(err)
			}
			for k, v := range sec.Data {
				if err := os.WriteFile(filepath.Join(local, k), v, 0o400); err != nil {
					s.t.Fatal(err)
				}
			}
			mounts[strings.TrimSuffix(m.MountPath, "/")] = local
		}
		var args []string
		for _, a := range append(slices.Clone(c.Command), c.Args...) {
			for path, local := range mounts {
				a = strings.ReplaceAll(a, path+"/", local+"/")
			}
			a = varRef.ReplaceAllStringFunc(a, func(m string) string {
				if v, ok := env[m[2:len(m)-1]]; ok {
					return v
				}
				return m
			})
			a = strings.ReplaceAll(a, "/csi/", dir+"/")
			a = strings.ReplaceAll(a, "stor-api:7400", s.ServerAddrs())
			if strings.HasPrefix(a, "--health-listen=") {
				addr, err := freeAddr()
				if err != nil {
					s.t.Fatal(err)
				}
				a = "--health-listen=" + addr
			}
			args = append(args, a)
		}
		if c.Name != "stor-csi" || slices.Contains(args, "--pvc-events") {
			args = append(args, "--kubeconfig="+kubeconfig)
		}
		var envList []string
		for k, v := range env {
			envList = append(envList, k+"="+v)
		}
		p, err := startProcAs(s.dir, pod.Name+"-"+c.Name, pod.Name, bin, args, envList)
		if err != nil {
			s.t.Fatal(err)
		}
		cp.Procs[c.Name] = p
	}
	s.Controllers[pod.Name] = cp // the pod's hostname: its sidecars' leader identity
	s.t.Cleanup(func() { cp.Stop(s) })
	return cp
}

// Kill kills one container's process (SIGKILL, as a crash).
func (cp *ControllerPod) Kill(container string) {
	if p := cp.Procs[container]; p != nil {
		p.stop(syscall.SIGKILL)
		delete(cp.Procs, container)
		cp.killed = append(cp.killed, p)
	}
}

// Stop kills every process of the pod (SIGKILL: a pod lost with its node).
func (cp *ControllerPod) Stop(s *Stack) {
	for name, p := range cp.Procs {
		s.dumpOnFailure(p)
		p.stop(syscall.SIGKILL)
		delete(cp.Procs, name)
	}
	for _, p := range cp.killed {
		s.dumpOnFailure(p)
	}
	cp.killed = nil
}

func (s *Stack) dumpOnFailure(p *proc) {
	if s.t.Failed() || os.Getenv("STOR_K8S_LOGS") != "" {
		s.t.Logf("---- %s (%s):\n%s", p.name, p.logPath, p.tail(8<<10))
	}
}

// Check fails the test if a process of the stack exited.
func (s *Stack) Check() {
	s.t.Helper()
	s.CP.Check()
	for _, cp := range s.Controllers {
		for name, p := range cp.Procs {
			if done, err := p.exited(); done {
				s.t.Fatalf("k8stest: %s of %s exited (%v):\n%s", name, cp.Pod.Name, err, p.tail(logTail))
			}
		}
	}
}

// retryTimeout bounds poll's attempts when ctx has no earlier deadline.
const retryTimeout = 2 * time.Minute

// poll calls f until it succeeds, ctx ends or retryTimeout passes.
func poll(ctx context.Context, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, retryTimeout)
	defer cancel()
	var err error
	for {
		if err = f(); err == nil {
			return nil
		}
		if apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pollInterval):
		}
	}
}

type testWriter struct{ t testing.TB }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
