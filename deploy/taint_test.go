package deploy

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// The out-of-service taint is added even when the node lifecycle
// controller updates the node between the test's read and its update (a
// conflict, as make k8s once hit), and nothing else of the node is lost.
func TestOutOfServiceTaintSurvivesAConflict(t *testing.T) {
	c := fake.NewSimpleClientset(&corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-b"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: "node.kubernetes.io/unreachable", Effect: corev1.TaintEffectNoExecute}}},
	})
	conflicts := 0
	c.PrependReactor("update", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if conflicts > 0 {
			return false, nil, nil
		}
		conflicts++
		return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "nodes"}, "node-b", nil)
	})
	if err := addOutOfServiceTaint(context.Background(), c, "node-b"); err != nil {
		t.Fatalf("with one conflicting update: %v", err)
	}
	n, err := c.CoreV1().Nodes().Get(context.Background(), "node-b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, taint := range n.Spec.Taints {
		keys = append(keys, taint.Key)
	}
	if len(keys) != 2 || keys[0] != "node.kubernetes.io/unreachable" || keys[1] != "node.kubernetes.io/out-of-service" {
		t.Fatalf("taints after the update: %v", keys)
	}
}
