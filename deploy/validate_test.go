package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/stor-io/stor/internal/k8stest"
)

// The names the manifests must agree on.
const (
	// driverName is stor-csi's default --driver-name (issue 6).
	driverName = "csi.stor.io"
	// csiContainer is the name of the stor-csi container in the CSI pods.
	csiContainer = "stor-csi"
	// serverContainer is the name of the stor-server container.
	serverContainer = "stor-server"
	// serverStatefulSet is the StatefulSet of the storage servers.
	serverStatefulSet = "stor-server"
)

// object is one decoded manifest object and where it came from.
type object struct {
	source string // kustomization dir or file
	obj    runtime.Object
	gvk    schema.GroupVersionKind
}

// name is how errors name an object: Kind namespace/name.
func (o object) name() string {
	m := metaOf(o.obj)
	if m.ns == "" {
		return o.gvk.Kind + " " + m.name
	}
	return o.gvk.Kind + " " + m.ns + "/" + m.name
}

type meta struct{ ns, name string }

func metaOf(obj runtime.Object) meta {
	type metaObject interface {
		GetNamespace() string
		GetName() string
	}
	if m, ok := obj.(metaObject); ok {
		return meta{m.GetNamespace(), m.GetName()}
	}
	return meta{}
}

// strictDecoder decodes YAML into the Kubernetes types registered in
// client-go's scheme plus the VolumeSnapshot v1 and cert-manager types, refusing unknown and
// duplicate fields and unknown kinds.
func strictDecoder() (runtime.Decoder, error) {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := snapshotv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	// cert-manager's Issuer and Certificate, as far as deploy/ uses them
	// (the fields the k8s tier's stand-in for cert-manager understands).
	if err := k8stest.AddCertManagerToScheme(scheme); err != nil {
		return nil, err
	}
	return json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme, scheme,
		json.SerializerOptions{Yaml: true, Strict: true}), nil
}

// render runs kustomize (krusty, as kubectl apply -k would) on dir in fsys
// and returns each rendered object as a YAML document.
func render(fsys filesys.FileSystem, dir string) ([][]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	var docs [][]byte
	for _, r := range m.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			return nil, fmt.Errorf("kustomize %s: %s: %w", dir, r.CurId(), err)
		}
		docs = append(docs, y)
	}
	return docs, nil
}

// splitYAML splits a multi-document YAML file, dropping empty documents.
func splitYAML(data []byte) ([][]byte, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(stripComments(doc))) > 0 {
			docs = append(docs, doc)
		}
	}
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' && !bytes.Equal(t, []byte("---")) {
			out = append(out, line...)
			out = append(out, '\n')
		}
	}
	return out
}

// decodeAll decodes docs strictly. Every document that does not decode is
// an error naming its source and, when it has one, its kind and name.
func decodeAll(dec runtime.Decoder, source string, docs [][]byte) ([]object, []error) {
	var objs []object
	var errs []error
	for i, doc := range docs {
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: document %d (%s): %w", source, i+1, docIdentity(doc), err))
			continue
		}
		objs = append(objs, object{source: source, obj: obj, gvk: *gvk})
	}
	return objs, errs
}

var (
	kindLine = regexp.MustCompile(`(?m)^kind:\s*(\S+)`)
	nameLine = regexp.MustCompile(`(?m)^  name:\s*(\S+)`)
)

// docIdentity names an undecodable document by its kind and name lines.
func docIdentity(doc []byte) string {
	kind, name := "?", "?"
	if m := kindLine.FindSubmatch(doc); m != nil {
		kind = string(m[1])
	}
	if m := nameLine.FindSubmatch(doc); m != nil {
		name = string(m[1])
	}
	return kind + " " + name
}

// podTemplate is a pod spec from a workload or a bare pod.
type podTemplate struct {
	owner  string // the workload, as object.name
	ns     string
	labels map[string]string
	spec   *corev1.PodSpec
	claims []corev1.PersistentVolumeClaim // a StatefulSet's volumeClaimTemplates
}

func podTemplates(objs []object) []podTemplate {
	var out []podTemplate
	for _, o := range objs {
		ns := metaOf(o.obj).ns
		switch w := o.obj.(type) {
		case *appsv1.Deployment:
			out = append(out, podTemplate{o.name(), ns, w.Spec.Template.Labels, &w.Spec.Template.Spec, nil})
		case *appsv1.DaemonSet:
			out = append(out, podTemplate{o.name(), ns, w.Spec.Template.Labels, &w.Spec.Template.Spec, nil})
		case *appsv1.StatefulSet:
			out = append(out, podTemplate{o.name(), ns, w.Spec.Template.Labels, &w.Spec.Template.Spec, w.Spec.VolumeClaimTemplates})
		case *corev1.Pod:
			out = append(out, podTemplate{o.name(), ns, w.Labels, &w.Spec, nil})
		}
	}
	return out
}

func allContainers(spec *corev1.PodSpec) []corev1.Container {
	return append(slices.Clone(spec.InitContainers), spec.Containers...)
}

// flagValue returns the value of --name=value in args, if given.
func flagValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// commandLine is a container's command and args. The stor containers run
// `sh -c 'exec "$0" "$@" --zone=...'` with the binary and its flags as args.
func commandLine(c corev1.Container) []string {
	return append(slices.Clone(c.Command), c.Args...)
}

// mountFor returns the volume mounted in c at the directory holding file.
func mountFor(c corev1.Container, file string) (corev1.VolumeMount, bool) {
	dir := path.Dir(file)
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) == dir {
			return m, true
		}
	}
	return corev1.VolumeMount{}, false
}

func volumeNamed(spec *corev1.PodSpec, name string) (corev1.Volume, bool) {
	for _, v := range spec.Volumes {
		if v.Name == name {
			return v, true
		}
	}
	return corev1.Volume{}, false
}

// crossCheck returns every broken cross-reference among objs.
func crossCheck(objs []object, flagsOf map[string][]string) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	type key struct{ kind, ns, name string }
	have := map[key]bool{}
	for _, o := range objs {
		m := metaOf(o.obj)
		have[key{o.gvk.Kind, m.ns, m.name}] = true
	}

	// The driver name, everywhere it appears.
	var drivers int
	for _, o := range objs {
		switch x := o.obj.(type) {
		case *storagev1.CSIDriver:
			drivers++
			if x.Name != driverName {
				fail("%s: name %q, want the driver's name %q", o.name(), x.Name, driverName)
			}
			if x.Spec.AttachRequired == nil || !*x.Spec.AttachRequired {
				fail("%s: attachRequired must be true: ControllerPublish is the fencing epoch", o.name())
			}
			if x.Spec.PodInfoOnMount != nil && *x.Spec.PodInfoOnMount {
				fail("%s: podInfoOnMount is true, but stor-csi uses no pod information", o.name())
			}
		case *storagev1.StorageClass:
			if x.Provisioner != driverName {
				fail("%s: provisioner %q is not the CSIDriver %q", o.name(), x.Provisioner, driverName)
			}
		case *snapshotv1.VolumeSnapshotClass:
			if x.Driver != driverName {
				fail("%s: driver %q is not the CSIDriver %q", o.name(), x.Driver, driverName)
			}
		}
	}
	if drivers > 1 {
		fail("%d CSIDriver objects, want one", drivers)
	}

	// The provisioner's role: what external-provisioner needs for restores
	// (it watches the source VolumeSnapshot and updates its finalizers).
	for _, o := range objs {
		if r, ok := o.obj.(*rbacv1.ClusterRole); ok && strings.Contains(r.Name, "provisioner") {
			if missing := missingVerbs(r.Rules, "snapshot.storage.k8s.io", "volumesnapshots", "get", "list", "watch", "update"); len(missing) > 0 {
				fail("%s: volumesnapshots lacks %v (external-provisioner watches restore sources and updates their finalizers)", o.name(), missing)
			}
		}
	}

	// Roles and accounts that bindings name exist.
	checkSubjects := func(o object, subjects []rbacv1.Subject) {
		for _, s := range subjects {
			if s.Kind == rbacv1.ServiceAccountKind && !have[key{"ServiceAccount", s.Namespace, s.Name}] {
				fail("%s: subject ServiceAccount %s/%s does not exist", o.name(), s.Namespace, s.Name)
			}
		}
	}
	for _, o := range objs {
		switch b := o.obj.(type) {
		case *rbacv1.ClusterRoleBinding:
			checkSubjects(o, b.Subjects)
			if b.RoleRef.Kind != "ClusterRole" || !have[key{"ClusterRole", "", b.RoleRef.Name}] {
				fail("%s: roleRef %s %s does not exist", o.name(), b.RoleRef.Kind, b.RoleRef.Name)
			}
		case *rbacv1.RoleBinding:
			checkSubjects(o, b.Subjects)
			ns := "" // a ClusterRole
			if b.RoleRef.Kind == "Role" {
				ns = b.Namespace
			}
			if !have[key{b.RoleRef.Kind, ns, b.RoleRef.Name}] {
				fail("%s: roleRef %s %s does not exist", o.name(), b.RoleRef.Kind, b.RoleRef.Name)
			}
		}
	}

	// Certificates: each is issued by an Issuer of its namespace, and a
	// CA Issuer's secret is made by an isCA Certificate.
	certSecrets := map[key]bool{} // Secret -> a Certificate makes it
	caSecrets := map[key]bool{}
	for _, o := range objs {
		if c, ok := o.obj.(*k8stest.Certificate); ok {
			certSecrets[key{"Secret", c.Namespace, c.Spec.SecretName}] = true
			if c.Spec.IsCA {
				caSecrets[key{"Secret", c.Namespace, c.Spec.SecretName}] = true
			}
		}
	}
	for _, o := range objs {
		switch x := o.obj.(type) {
		case *k8stest.Certificate:
			if x.Spec.IssuerRef.Kind != "Issuer" || !have[key{"Issuer", x.Namespace, x.Spec.IssuerRef.Name}] {
				fail("%s: issuerRef %s %q is not an Issuer of namespace %q", o.name(), x.Spec.IssuerRef.Kind, x.Spec.IssuerRef.Name, x.Namespace)
			}
		case *k8stest.Issuer:
			if x.Spec.CA != nil && !caSecrets[key{"Secret", x.Namespace, x.Spec.CA.SecretName}] {
				fail("%s: ca.secretName %q is made by no isCA Certificate", o.name(), x.Spec.CA.SecretName)
			}
		}
	}

	pods := podTemplates(objs)
	for _, p := range pods {
		spec := p.spec
		if sa := spec.ServiceAccountName; sa != "" && !have[key{"ServiceAccount", p.ns, sa}] {
			fail("%s: serviceAccountName %q does not exist in namespace %q", p.owner, sa, p.ns)
		}
		for _, v := range spec.Volumes {
			if v.Secret != nil && !certSecrets[key{"Secret", p.ns, v.Secret.SecretName}] && !have[key{"Secret", p.ns, v.Secret.SecretName}] {
				fail("%s: volume %s: Secret %q is made by no Certificate and is not in deploy/", p.owner, v.Name, v.Secret.SecretName)
			}
		}
		volumes := map[string]bool{}
		for _, v := range spec.Volumes {
			volumes[v.Name] = true
		}
		for _, c := range p.claims {
			volumes[c.Name] = true
		}
		for _, c := range allContainers(spec) {
			for _, m := range c.VolumeMounts {
				if !volumes[m.Name] {
					fail("%s: container %s mounts volume %q, which the pod does not have", p.owner, c.Name, m.Name)
				}
			}
			// $(VAR) in command and args must be an env var of the container
			// (Kubernetes leaves an unknown one unexpanded, silently).
			env := map[string]bool{}
			for _, e := range c.Env {
				env[e.Name] = true
			}
			refs := commandLine(c)
			for _, m := range c.VolumeMounts {
				refs = append(refs, m.SubPathExpr)
			}
			for _, a := range refs {
				for _, m := range envRef.FindAllStringSubmatch(a, -1) {
					if !env[m[1]] {
						fail("%s: container %s: argument %q uses $(%s), which is not in its env", p.owner, c.Name, a, m[1])
					}
				}
			}
			if c.Resources.Requests == nil && !strings.HasPrefix(p.owner, "Pod ") {
				fail("%s: container %s has no resource requests", p.owner, c.Name)
			}
		}
		checkCSIPod(p, fail)
		checkCSIProbes(p, fail)
		checkCSIModeFlags(p, fail)
		checkNodeMemory(p, fail)
		checkStorImages(p, fail)
		checkNodeMounts(p, fail)
		checkNodeHostNetwork(p, fail)
		checkServerPod(p, objs, fail)
		for _, c := range allContainers(spec) {
			if bin, args, ok := storBinary(c); ok {
				known := flagsOf[bin]
				for _, a := range args {
					name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
					if strings.HasPrefix(a, "--") && !slices.Contains(known, name) {
						fail("%s: container %s: %s has no flag --%s", p.owner, c.Name, bin, name)
					}
				}
			}
		}
	}

	// Services select pods that exist; a StatefulSet's service is headless.
	for _, o := range objs {
		svc, ok := o.obj.(*corev1.Service)
		if !ok || len(svc.Spec.Selector) == 0 {
			continue
		}
		matched := false
		for _, p := range pods {
			if p.ns == svc.Namespace && selects(svc.Spec.Selector, p.labels) {
				matched = true
			}
		}
		if !matched {
			fail("%s: selector %v matches no pod template", o.name(), svc.Spec.Selector)
		}
	}
	for _, o := range objs {
		sts, ok := o.obj.(*appsv1.StatefulSet)
		if !ok {
			continue
		}
		var svc *corev1.Service
		for _, x := range objs {
			if s, ok := x.obj.(*corev1.Service); ok && s.Name == sts.Spec.ServiceName && s.Namespace == sts.Namespace {
				svc = s
			}
		}
		if svc == nil || svc.Spec.ClusterIP != corev1.ClusterIPNone {
			fail("%s: serviceName %q is not a headless Service", o.name(), sts.Spec.ServiceName)
		}
	}
	return errs
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

func selects(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// storBinary reports whether c runs stor-server or stor-csi, and with which
// flags: either directly (command or args[0]) or behind the sh -c wrapper.
func storBinary(c corev1.Container) (bin string, args []string, ok bool) {
	line := commandLine(c)
	for i, a := range line {
		if strings.HasPrefix(a, "-") {
			continue
		}
		if b := path.Base(a); b == "stor-server" || b == "stor-csi" {
			return b, line[i+1:], true
		}
	}
	if c.Name == csiContainer || c.Name == serverContainer {
		// The image's entrypoint with only flags.
		return c.Name, c.Args, true
	}
	return "", nil, false
}

// driverContainer returns the pod's stor-csi container, or nil.
func driverContainer(p podTemplate) *corev1.Container {
	for i, c := range p.spec.Containers {
		if c.Name == csiContainer {
			return &p.spec.Containers[i]
		}
	}
	return nil
}

// checkCSIPod checks a pod that runs stor-csi: its driver name, and that
// every sidecar reaches the driver's socket through the same volume.
func checkCSIPod(p podTemplate, fail func(string, ...any)) {
	driver := driverContainer(p)
	if driver == nil {
		return
	}
	_, args, _ := storBinary(*driver)
	if name, ok := flagValue(args, "driver-name"); !ok || name != driverName {
		fail("%s: stor-csi --driver-name %q, want %q", p.owner, name, driverName)
	}
	endpoint, _ := flagValue(args, "endpoint")
	sock, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || !path.IsAbs(sock) {
		fail("%s: stor-csi --endpoint %q is not unix:///absolute/path", p.owner, endpoint)
		return
	}
	driverMount, ok := mountFor(*driver, sock)
	if !ok {
		fail("%s: stor-csi's socket dir %s is not a volume mount", p.owner, path.Dir(sock))
		return
	}
	sidecars := 0
	for _, c := range p.spec.Containers {
		addr, ok := flagValue(c.Args, "csi-address")
		if !ok || c.Name == csiContainer {
			continue
		}
		sidecars++
		m, ok := mountFor(c, addr)
		switch {
		case !ok:
			fail("%s: sidecar %s: --csi-address %s: its directory is not a volume mount", p.owner, c.Name, addr)
		case m.Name != driverMount.Name:
			fail("%s: sidecar %s: --csi-address %s is on volume %q, stor-csi's endpoint %s on %q", p.owner, c.Name, addr, m.Name, endpoint, driverMount.Name)
		case path.Base(addr) != path.Base(sock):
			fail("%s: sidecar %s: --csi-address %s, stor-csi listens on %s", p.owner, c.Name, addr, sock)
		}
		// The registrar tells the kubelet where the socket is on the host.
		if reg, ok := flagValue(c.Args, "kubelet-registration-path"); ok {
			v, _ := volumeNamed(p.spec, driverMount.Name)
			want := ""
			if v.HostPath != nil {
				want = path.Join(v.HostPath.Path, path.Base(sock))
			}
			if reg != want {
				fail("%s: sidecar %s: --kubelet-registration-path %s, but the socket is at %q on the host", p.owner, c.Name, reg, want)
			}
			if !strings.Contains(reg, "/plugins/"+driverName+"/") {
				fail("%s: sidecar %s: --kubelet-registration-path %s is not under the driver's plugin dir", p.owner, c.Name, reg)
			}
		}
	}
	if sidecars == 0 {
		fail("%s: no sidecar talks to stor-csi", p.owner)
	}
}

// checkServerPod checks the stor-server StatefulSet: HTTP probes on the
// port of --metrics-listen, where stor-server serves /healthz and /readyz
// (liveness and startup never ask /readyz: a server without a leader is
// not restarted), and a --join list naming exactly the StatefulSet's pods.
func checkServerPod(p podTemplate, objs []object, fail func(string, ...any)) {
	var c *corev1.Container
	for i := range p.spec.Containers {
		if p.spec.Containers[i].Name == serverContainer {
			c = &p.spec.Containers[i]
		}
	}
	if c == nil {
		return
	}
	_, args, _ := storBinary(*c)
	listen, _ := flagValue(args, "listen")
	_, port, err := netSplit(listen)
	if err != nil {
		fail("%s: stor-server --listen %q: %v", p.owner, listen, err)
		return
	}
	metricsListen, ok := flagValue(args, "metrics-listen")
	if !ok {
		fail("%s: stor-server has no --metrics-listen: nothing serves /healthz and /readyz", p.owner)
		return
	}
	_, metricsPort, err := netSplit(metricsListen)
	if err != nil {
		fail("%s: stor-server --metrics-listen %q: %v", p.owner, metricsListen, err)
		return
	}
	probe := func(what string, pr *corev1.Probe, path string) {
		switch {
		case pr == nil:
			fail("%s: stor-server has no %s probe", p.owner, what)
		case pr.HTTPGet == nil:
			fail("%s: stor-server %s probe is not an HTTP probe of --metrics-listen", p.owner, what)
		case strconv.Itoa(int(probePort(*c, pr.HTTPGet.Port))) != metricsPort:
			fail("%s: stor-server %s probe on port %d, --metrics-listen is on %s", p.owner, what, probePort(*c, pr.HTTPGet.Port), metricsPort)
		case pr.HTTPGet.Path != path:
			fail("%s: stor-server %s probe asks %s, want %s", p.owner, what, pr.HTTPGet.Path, path)
		}
	}
	probe("readiness", c.ReadinessProbe, "/readyz")
	probe("liveness", c.LivenessProbe, "/healthz")
	if c.StartupProbe != nil {
		probe("startup", c.StartupProbe, "/healthz")
	}

	// Data locality: CSI's selected node is a Kubernetes node, which
	// placement matches against the server's --k8s-node; only the pod's
	// spec.nodeName is that.
	node, ok := flagValue(args, "k8s-node")
	m := envRef.FindStringSubmatch(node)
	switch {
	case !ok:
		fail("%s: stor-server has no --k8s-node: no volume gets a replica on the node that uses it", p.owner)
	case m == nil || m[0] != node || fieldRefOf(*c, m[1]) != "spec.nodeName":
		fail("%s: stor-server --k8s-node=%s is not $(VAR) of the pod's spec.nodeName", p.owner, node)
	}

	var sts *appsv1.StatefulSet
	for _, o := range objs {
		if s, ok := o.obj.(*appsv1.StatefulSet); ok && o.name() == p.owner {
			sts = s
		}
	}
	if sts == nil || sts.Name != serverStatefulSet {
		return
	}
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	expand := func(s string) string {
		return envRef.ReplaceAllStringFunc(s, func(m string) string {
			name := m[2 : len(m)-1]
			if name == "POD_NAMESPACE" {
				return sts.Namespace
			}
			if v, ok := env[name]; ok {
				return v
			}
			return m
		})
	}
	join, _ := flagValue(args, "join")
	seeds := strings.Split(expand(expand(join)), ",")
	replicas := 1
	if sts.Spec.Replicas != nil {
		replicas = int(*sts.Spec.Replicas)
	}
	var want []string
	for i := range replicas {
		want = append(want, fmt.Sprintf("%s-%d.%s.%s.svc:%s", sts.Name, i, sts.Spec.ServiceName, sts.Namespace, port))
	}
	if !slices.Equal(seeds, want) {
		fail("%s: --join %v, want the %d pods %v", p.owner, seeds, replicas, want)
	}
	voters, err := strconv.Atoi(expand(must(flagValue(args, "max-voters"))))
	if err != nil || voters < 1 || voters > replicas || voters%2 == 0 {
		fail("%s: --max-voters %q: want an odd number of voters, at most the %d replicas", p.owner, expand(must(flagValue(args, "max-voters"))), replicas)
	}
}

func must(s string, _ bool) string { return s }

// fieldRefOf returns the downward-API field env var name of c reads, or "".
func fieldRefOf(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			return e.ValueFrom.FieldRef.FieldPath
		}
	}
	return ""
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func netSplit(addr string) (host, port string, err error) {
	i := strings.LastIndexByte(addr, ':')
	if i < 0 {
		return "", "", fmt.Errorf("no port")
	}
	if _, err := strconv.Atoi(addr[i+1:]); err != nil {
		return "", "", fmt.Errorf("bad port: %w", err)
	}
	return addr[:i], addr[i+1:], nil
}

// flagsInSource lists the flag names a command defines, read from its Go
// source (the flag package's fs.String/StringVar/... and pflag's ...P forms):
// the first string literal of each definition call.
func flagsInSource(dir string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no Go files in %s: %v", dir, err)
	}
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		for _, m := range flagDef.FindAllSubmatch(src, -1) {
			seen[string(m[1])] = true
		}
	}
	var out []string
	for f := range seen {
		out = append(out, f)
	}
	sort.Strings(out)
	return out, nil
}

var flagDef = regexp.MustCompile(`\.(?:String|Bool|Int|Int64|Uint|Uint64|Uint32|Float64|Duration|Func|Var|TextVar|StringSlice)(?:Var)?P?\((?:&?[\w.\[\]]+,\s*)?"([a-z0-9][a-z0-9-]*)"`)

// checkExamples checks that the examples use classes the base defines and
// claims and snapshots the examples define.
func checkExamples(examples, base []object) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	classes, snapClasses, claims, snaps := map[string]bool{}, map[string]bool{}, map[string]bool{}, map[string]bool{}
	for _, o := range base {
		switch x := o.obj.(type) {
		case *storagev1.StorageClass:
			classes[x.Name] = true
		case *snapshotv1.VolumeSnapshotClass:
			snapClasses[x.Name] = true
		}
	}
	for _, o := range examples {
		switch x := o.obj.(type) {
		case *corev1.PersistentVolumeClaim:
			claims[x.Name] = true
		case *snapshotv1.VolumeSnapshot:
			snaps[x.Name] = true
		}
	}
	for _, o := range examples {
		switch x := o.obj.(type) {
		case *corev1.PersistentVolumeClaim:
			if sc := deref(x.Spec.StorageClassName); !classes[sc] {
				fail("%s (%s): storageClassName %q is not a StorageClass of the base", o.name(), o.source, sc)
			}
			if ds := x.Spec.DataSource; ds != nil && ds.Kind == "VolumeSnapshot" && !snaps[ds.Name] {
				fail("%s (%s): dataSource VolumeSnapshot %q is not in the examples", o.name(), o.source, ds.Name)
			}
		case *snapshotv1.VolumeSnapshot:
			if c := deref(x.Spec.VolumeSnapshotClassName); !snapClasses[c] {
				fail("%s (%s): volumeSnapshotClassName %q is not a VolumeSnapshotClass of the base", o.name(), o.source, c)
			}
			if src := deref(x.Spec.Source.PersistentVolumeClaimName); !claims[src] {
				fail("%s (%s): source claim %q is not in the examples", o.name(), o.source, src)
			}
		case *corev1.Pod:
			for _, v := range x.Spec.Volumes {
				if v.PersistentVolumeClaim != nil && !claims[v.PersistentVolumeClaim.ClaimName] {
					fail("%s (%s): claim %q is not in the examples", o.name(), o.source, v.PersistentVolumeClaim.ClaimName)
				}
			}
		}
	}
	return errs
}

// missingVerbs returns the verbs of want that no rule grants on resource
// in group.
func missingVerbs(rules []rbacv1.PolicyRule, group, resource string, want ...string) []string {
	var missing []string
	for _, v := range want {
		granted := slices.ContainsFunc(rules, func(r rbacv1.PolicyRule) bool {
			return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) &&
				(slices.Contains(r.Verbs, v) || slices.Contains(r.Verbs, "*"))
		})
		if !granted {
			missing = append(missing, v)
		}
	}
	return missing
}

// checkNodeMounts: no container mounts the whole kubelet directory (or a
// parent of it) from the host; the node plugin needs only its plugins and
// pods directories. And no sidecar is given a feature gate that has gone
// GA (Topology): the flag may be removed in any release.
func checkNodeMounts(p podTemplate, fail func(string, ...any)) {
	for _, c := range allContainers(p.spec) {
		for _, m := range c.VolumeMounts {
			v, ok := volumeNamed(p.spec, m.Name)
			if !ok || v.HostPath == nil {
				continue
			}
			host := path.Clean(v.HostPath.Path)
			if host == "/" || host == "/var" || host == "/var/lib" || host == "/var/lib/kubelet" {
				fail("%s: container %s mounts the host's %s; mount only /var/lib/kubelet/plugins and /var/lib/kubelet/pods", p.owner, c.Name, host)
			}
		}
		for _, a := range c.Args {
			if gates, ok := strings.CutPrefix(a, "--feature-gates="); ok && strings.Contains(gates, "Topology=") {
				fail("%s: container %s: %s: Topology is GA, the gate must not be set", p.owner, c.Name, a)
			}
		}
	}
}
