package k8stest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Bounds on starting the control plane.
const (
	startTimeout = 2 * time.Minute
	pollInterval = 200 * time.Millisecond
	logTail      = 16 << 10
)

// ControlPlane is etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler as processes on loopback.
type ControlPlane struct {
	t      testing.TB
	bin    string
	dir    string
	pki    *pki
	server string // https://127.0.0.1:port
	procs  map[string]*proc

	// Admin is a system:masters client config.
	Admin   *rest.Config
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
}

// NodeMonitorGracePeriod is how long a node may go without a heartbeat
// before the node lifecycle controller marks it NotReady (the
// controller-manager's --node-monitor-grace-period; Kubernetes' default
// is 50s).
const NodeMonitorGracePeriod = 12 * time.Second

// StartControlPlane starts the control plane from the binaries in bin (the
// bin directory scripts/k8s-tools.sh prints), with its files under dir.
// Everything is stopped in t.Cleanup; a failed test prints each
// process's log tail.
func StartControlPlane(t testing.TB, bin, dir string) *ControlPlane {
	t.Helper()
	cp := &ControlPlane{t: t, bin: bin, dir: dir, procs: map[string]*proc{}}
	t.Cleanup(cp.stop)
	var err error
	if cp.pki, err = newPKI(dir); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	etcdClient, err := freePort()
	must(err)
	etcdPeer, err := freePort()
	must(err)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdClient)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeer)
	cp.start("etcd", "etcd",
		"--name=k8stest", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=k8stest="+peerURL, "--unsafe-no-fsync", "--log-level=warn")

	apiPort, err := freePort()
	must(err)
	cp.server = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	servingCert, servingKey, err := cp.pki.issue("apiserver", "kube-apiserver", nil,
		"127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "10.96.0.1")
	must(err)
	saPub, saKey, err := cp.pki.serviceAccountKey()
	must(err)
	cp.start("kube-apiserver", "kube-apiserver",
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(apiPort),
		"--tls-cert-file="+servingCert, "--tls-private-key-file="+servingKey,
		"--client-ca-file="+cp.pki.caFile,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
		"--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=true",
		// The kubernetes Service's endpoints would be 127.0.0.1, which the
		// reconciler refuses; nothing here reaches the apiserver through it.
		"--endpoint-reconciler-type=none",
		"--cert-dir="+filepath.Join(dir, "apiserver-certs"), "--v=1")

	adminCert, adminKey, err := cp.pki.issue("admin", "k8stest-admin", []string{"system:masters"})
	must(err)
	cp.Admin = cp.certConfig(adminCert, adminKey)
	if cp.Client, err = kubernetes.NewForConfig(cp.Admin); err != nil {
		t.Fatal(err)
	}
	if cp.Dynamic, err = dynamic.NewForConfig(cp.Admin); err != nil {
		t.Fatal(err)
	}
	cp.waitReady()

	kcmCert, kcmKey, err := cp.pki.issue("kcm", "system:kube-controller-manager", nil)
	must(err)
	kcm, err := cp.pki.kubeconfig("kcm", cp.server, kcmCert, kcmKey, "")
	must(err)
	cp.start("kube-controller-manager", "kube-controller-manager",
		"--kubeconfig="+kcm, "--authentication-kubeconfig="+kcm, "--authorization-kubeconfig="+kcm,
		"--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file="+saKey, "--root-ca-file="+cp.pki.caFile,
		"--node-monitor-period=2s", "--node-monitor-grace-period="+NodeMonitorGracePeriod.String(),
		"--v=2")
	schedCert, schedKey, err := cp.pki.issue("scheduler", "system:kube-scheduler", nil)
	must(err)
	sched, err := cp.pki.kubeconfig("scheduler", cp.server, schedCert, schedKey, "")
	must(err)
	cp.start("kube-scheduler", "kube-scheduler",
		"--kubeconfig="+sched, "--authentication-kubeconfig="+sched, "--authorization-kubeconfig="+sched,
		"--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false", "--v=2")
	return cp
}

func (cp *ControlPlane) certConfig(cert, key string) *rest.Config {
	return &rest.Config{
		Host:            cp.server,
		TLSClientConfig: rest.TLSClientConfig{CAFile: cp.pki.caFile, CertFile: cert, KeyFile: key},
		QPS:             100, Burst: 200,
	}
}

// NodeConfig is a client config with the credentials a kubelet of node
// name has (user system:node:name in group system:nodes), so the Node
// authorizer and NodeRestriction apply to it.
func (cp *ControlPlane) NodeConfig(name string) *rest.Config {
	cp.t.Helper()
	cert, key, err := cp.pki.issue("node-"+name, "system:node:"+name, []string{"system:nodes"})
	if err != nil {
		cp.t.Fatal(err)
	}
	return cp.certConfig(cert, key)
}

// TokenKubeconfig writes a kubeconfig with a bearer token (a service
// account's) and returns its path.
func (cp *ControlPlane) TokenKubeconfig(name, token string) string {
	cp.t.Helper()
	path, err := cp.pki.kubeconfig(name, cp.server, "", "", token)
	if err != nil {
		cp.t.Fatal(err)
	}
	return path
}

func (cp *ControlPlane) start(name, bin string, args ...string) {
	cp.t.Helper()
	// The controller-manager's node monitor grace period must exceed
	// client-go's HTTP/2 health check (read idle + ping timeouts, 30s +
	// 15s by default); NodeMonitorGracePeriod is shorter, so are they.
	env := []string{"HTTP2_READ_IDLE_TIMEOUT_SECONDS=4", "HTTP2_PING_TIMEOUT_SECONDS=2"}
	p, err := startProc(cp.dir, name, filepath.Join(cp.bin, bin), args, env)
	if err != nil {
		cp.t.Fatal(err)
	}
	cp.procs[name] = p
}

func (cp *ControlPlane) waitReady() {
	cp.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	var last error
	for ctx.Err() == nil {
		for name, p := range cp.procs {
			if done, err := p.exited(); done {
				cp.t.Fatalf("k8stest: %s exited (%v):\n%s", name, err, p.tail(logTail))
			}
		}
		body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && string(body) == "ok" {
			return
		}
		last = fmt.Errorf("%v %s", err, body)
		time.Sleep(pollInterval)
	}
	cp.t.Fatalf("k8stest: kube-apiserver not ready within %v: %v\n%s", startTimeout, last, cp.procs["kube-apiserver"].tail(logTail))
}

// Check fails the test if a control-plane process has exited.
func (cp *ControlPlane) Check() {
	cp.t.Helper()
	for name, p := range cp.procs {
		if done, err := p.exited(); done {
			cp.t.Fatalf("k8stest: %s exited (%v):\n%s", name, err, p.tail(logTail))
		}
	}
}

func (cp *ControlPlane) stop() {
	if cp.t.Failed() || os.Getenv("STOR_K8S_LOGS") != "" {
		for _, name := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd"} {
			if p := cp.procs[name]; p != nil {
				cp.t.Logf("---- %s (%s):\n%s", name, p.logPath, p.tail(logTail))
			}
		}
	}
	for _, name := range []string{"kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"} {
		if p := cp.procs[name]; p != nil {
			p.stop(syscall.SIGTERM)
		}
	}
}
