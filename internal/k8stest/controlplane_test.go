package k8stest

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// toolsDir is scripts/k8s-tools.sh's output directory, from make k8s.
func toolsDir(t *testing.T) string {
	dir := os.Getenv("STOR_K8S_TOOLS")
	if dir == "" {
		t.Skip("the control plane tests run in make k8s (STOR_K8S_TOOLS names scripts/k8s-tools.sh's binaries)")
	}
	return dir
}

// The control plane is the real one: certificates, the Node authorizer
// and NodeRestriction apply, so what the harness's kubelets and sidecars
// may do is what a cluster lets them do.
func TestControlPlaneAuthorizes(t *testing.T) {
	cp := StartControlPlane(t, filepath.Join(toolsDir(t), "bin"), t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := cp.Client.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Fatalf("admin: %v", err)
	}
	node := func(name string) kubernetes.Interface {
		c, err := kubernetes.NewForConfig(cp.NodeConfig(name))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	n1 := node("n1")
	if _, err := n1.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("a kubelet registering its own Node: %v", err)
	}
	if _, err := n1.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n2"}}, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("a kubelet creating another node's Node: %v, want Forbidden (NodeRestriction)", err)
	}
	if _, err := n1.CoreV1().Secrets("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("a kubelet listing secrets: %v, want Forbidden (Node authorizer)", err)
	}
	anon, err := kubernetes.NewForConfig(&rest.Config{Host: cp.Admin.Host, TLSClientConfig: rest.TLSClientConfig{CAFile: cp.Admin.CAFile}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := anon.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) && !apierrors.IsUnauthorized(err) {
		t.Errorf("an anonymous client listing nodes: %v, want Forbidden or Unauthorized", err)
	}
	// The controller-manager and the scheduler came up with their flags
	// (a refused flag exits at once) and stay up.
	time.Sleep(3 * time.Second)
	cp.Check()
}
