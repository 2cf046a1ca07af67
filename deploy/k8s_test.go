package deploy

// The real control-plane tier (make k8s): deploy/'s base on a real
// kube-apiserver, controller-manager and scheduler with the real sidecars,
// through package k8stest. Every scenario is asserted on the Kubernetes
// objects and, where data is involved, on bytes written and read back
// through the node plugins' (fake-kernel) devices.

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/k8stest"
	"github.com/stor-io/stor/internal/pvcevents"
)

// k8sEnv names the directory scripts/k8s-tools.sh prints; make k8s sets it.
const k8sEnv = "STOR_K8S_TOOLS"

// Bounds on the scenarios' waits.
const (
	k8sWait    = 2 * time.Minute
	k8sPoll    = 250 * time.Millisecond
	testNS     = "default"
	claimSize  = "1Gi"
	dataOffset = 4096
)

var snapshotGVR = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}

func TestK8s(t *testing.T) {
	tools := os.Getenv(k8sEnv)
	if tools == "" {
		t.Skipf("the real control-plane tier runs in make k8s (%s names the binaries of scripts/k8s-tools.sh)", k8sEnv)
	}
	storCSI := filepath.Join(t.TempDir(), "stor-csi")
	build := exec.Command("go", "build", "-o", storCSI, "../cmd/stor-csi")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build stor-csi: %v\n%s", err, out)
	}
	docs, err := render(filesys.MakeFsOnDisk(), "kubernetes/base")
	if err != nil {
		t.Fatal(err)
	}
	s := k8stest.Start(t, k8stest.Options{Bin: tools, StorCSI: storCSI, Manifests: docs, Nodes: []k8stest.NodeSpec{
		{Name: "node-a", Zone: "zone-a", Server: true},
		{Name: "node-b", Zone: "zone-b", Server: true},
		{Name: "node-c", Zone: "zone-c", Server: true},
	}})
	k := &k8sT{s: s}

	var claim *corev1.PersistentVolumeClaim
	var data []byte
	var pod *corev1.Pod
	t.Run("WaitForFirstConsumerClaimIsScheduledAndBound", func(t *testing.T) {
		k.t = t
		claim = k.createClaim("data", claimSize, nil)
		pod = k.createPod("writer", claim.Name, nil)
		pod = k.waitRunning(pod)
		pv := k.boundPV(claim.Name)
		// The PV's affinity is zones only: a node added later can use it.
		for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
			for _, e := range term.MatchExpressions {
				if strings.HasSuffix(e.Key, "/node") || e.Key == corev1.LabelHostname {
					t.Errorf("PV %s is pinned to nodes: %s %v", pv.Name, e.Key, e.Values)
				}
			}
		}
		// Locality: one replica on the server of the pod's node.
		if !k.replicaOn(pv.Spec.CSI.VolumeHandle, pod.Spec.NodeName) {
			t.Errorf("no replica of %s on the server of node %s (the selected node)", pv.Name, pod.Spec.NodeName)
		}
		k.waitAttached(pv, pod.Spec.NodeName)
		data = bytes.Repeat([]byte("stor-k8s"), 512)
		k.write(pod, "data", data)
	})
	if t.Failed() {
		return
	}

	t.Run("NodeCertificatesFromTheTokenReview", func(t *testing.T) {
		k.t = t
		ctx, cancel := context.WithTimeout(context.Background(), k8sWait)
		defer cancel()
		podA, err := s.NodePluginPod(ctx, "node-a")
		if err != nil {
			t.Fatal(err)
		}
		boot, err := s.BootstrapClient(ctx, podA, filepath.Join(t.TempDir(), "bootstrap"))
		if err != nil {
			t.Fatal(err)
		}
		issue := func(token string) (*storpb.IssueNodeCertificateResponse, error) {
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			if err != nil {
				t.Fatal(err)
			}
			der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
			if err != nil {
				t.Fatal(err)
			}
			return boot.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{
				Token: token, Csr: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})})
		}
		// node-a's pod's token (audience stor): a certificate for node-a,
		// the node the API server's review names.
		tok, err := s.PodToken(ctx, podA, "stor")
		if err != nil {
			t.Fatal(err)
		}
		resp, err := issue(tok)
		if err != nil {
			t.Fatalf("IssueNodeCertificate with node-a's pod's token: %v", err)
		}
		blk, _ := pem.Decode(resp.CertificateChain)
		if blk == nil {
			t.Fatalf("no certificate in %q", resp.CertificateChain)
		}
		cert, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if len(cert.URIs) != 1 || cert.URIs[0].String() != "stor://csi-node/node-a" || resp.Node != "node-a" {
			t.Fatalf("node-a's pod got a certificate for %v (node %q)", cert.URIs, resp.Node)
		}
		// Another audience, or another ServiceAccount's pod: refused.
		if tok, err = s.PodToken(ctx, podA); err != nil {
			t.Fatal(err)
		}
		if _, err := issue(tok); status.Code(err) != codes.Unauthenticated {
			t.Errorf("a token for the API server's audience: %v, want Unauthenticated", err)
		}
		ctrl := s.Controllers[slices.Sorted(maps.Keys(s.Controllers))[0]].Pod
		if tok, err = s.PodToken(ctx, ctrl, "stor"); err != nil {
			t.Fatal(err)
		}
		if _, err := issue(tok); status.Code(err) != codes.PermissionDenied {
			t.Errorf("a csi-controller pod's token: %v, want PermissionDenied", err)
		}
		// The bootstrap certificate is good for nothing else.
		if _, err := boot.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{}); status.Code(err) != codes.PermissionDenied {
			t.Errorf("ListVolumes with the bootstrap certificate: %v, want PermissionDenied", err)
		}
	})

	t.Run("PodMovesToANodeAddedAfterThePV", func(t *testing.T) {
		k.t = t
		pv := k.boundPV(claim.Name)
		k.deletePod(pod)
		k.waitDetached(pv, pod.Spec.NodeName)
		s.AddNode(k8stest.NodeSpec{Name: "node-late", Zone: "zone-a"})
		pod = k.createPod("late", claim.Name, map[string]string{corev1.LabelHostname: "node-late"})
		pod = k.waitRunning(pod)
		k.waitAttached(pv, "node-late")
		if got := k.read(pod, "data", len(data)); !bytes.Equal(got, data) {
			t.Fatalf("node-late reads %q..., node-a wrote %q...", got[:16], data[:16])
		}
	})
	if t.Failed() {
		return
	}

	t.Run("ExpandOnline", func(t *testing.T) {
		k.t = t
		k.expand(claim.Name, "2Gi")
		k.waitFor("claim capacity 2Gi", func() (bool, error) {
			c, err := s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Get(k.ctx(), claim.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			q := c.Status.Capacity[corev1.ResourceStorage]
			return q.Cmp(resource.MustParse("2Gi")) == 0, nil
		})
		pv := k.boundPV(claim.Name)
		if got := k.volumeSize(pv.Spec.CSI.VolumeHandle); got != 2<<30 {
			t.Errorf("stor volume size %d after expansion, want %d", got, 2<<30)
		}
		if got := k.deviceSize(pod, "data"); got != 2<<30 {
			t.Errorf("the node's device is %d bytes after NodeExpandVolume, want %d", got, 2<<30)
		}
		// stor's event of the expansion, mirrored onto the claim by the
		// controller holding the Lease (stor-csi --pvc-events).
		k.waitFor("a VolumeExpanded Event on the claim", func() (bool, error) {
			l, err := s.CP.Client.CoreV1().Events(testNS).List(k.ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + claim.Name})
			if err != nil {
				return false, err
			}
			for _, e := range l.Items {
				if e.Reason == "VolumeExpanded" && e.Source.Component == "stor-csi-controller" && e.InvolvedObject.UID == claim.UID &&
					strings.Contains(e.Message, "to 2147483648 bytes") {
					return true, nil
				}
			}
			return false, nil
		})
	})

	var snap string
	t.Run("SnapshotRestoreIntoALargerClaim", func(t *testing.T) {
		k.t = t
		snap = k.createSnapshot("data-snap", claim.Name)
		k.waitSnapshotReady(snap)
		restored := k.createClaim("restored", "3Gi", &corev1.TypedLocalObjectReference{
			APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: snap})
		rp := k.waitRunning(k.createPod("restored", restored.Name, nil))
		if got := k.read(rp, "data", len(data)); !bytes.Equal(got, data) {
			t.Errorf("the restored claim reads %q..., the snapshot holds %q...", got[:16], data[:16])
		}
		if got := k.deviceSize(rp, "data"); got != 3<<30 {
			t.Errorf("restored device is %d bytes, want %d (the larger claim)", got, 3<<30)
		}
		k.deletePod(rp)
	})

	t.Run("ClaimDeletedWhileItsSnapshotLives", func(t *testing.T) {
		k.t = t
		pv := k.boundPV(claim.Name)
		k.deletePod(pod)
		k.waitDetached(pv, pod.Spec.NodeName)
		if err := s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Delete(k.ctx(), claim.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		k.waitFor("PV "+pv.Name+" deleted", func() (bool, error) {
			_, err := s.CP.Client.CoreV1().PersistentVolumes().Get(k.ctx(), pv.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			return false, err
		})
		k.waitSnapshotReady(snap)
		again := k.createClaim("after-delete", "2Gi", &corev1.TypedLocalObjectReference{
			APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: snap})
		ap := k.waitRunning(k.createPod("after-delete", again.Name, nil))
		if got := k.read(ap, "data", len(data)); !bytes.Equal(got, data) {
			t.Errorf("a claim restored after its source was deleted reads %q..., want %q...", got[:16], data[:16])
		}
		claim, pod = again, ap
	})
	if t.Failed() {
		return
	}

	t.Run("NodeLostForceDetachPodElsewhere", func(t *testing.T) {
		k.t = t
		pv := k.boundPV(claim.Name)
		lost := pod.Spec.NodeName
		more := bytes.Repeat([]byte("after-loss"), 410)[:4096] // whole blocks, as the kernel sends
		k.writeAt(pod, "data", more, 1<<20)
		// The node dies: kubelet and node plugin stop (nothing unmounted,
		// nothing detached).
		s.Nodes[lost].Kubelet.Stop()
		s.Nodes[lost].Plugin.Stop()
		k.waitFor("node "+lost+" not ready", func() (bool, error) {
			n, err := s.CP.Client.CoreV1().Nodes().Get(k.ctx(), lost, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range n.Status.Conditions {
				if c.Type == corev1.NodeReady {
					return c.Status != corev1.ConditionTrue, nil
				}
			}
			return false, nil
		})
		// The operator's non-graceful shutdown step: the out-of-service
		// taint; pod GC force-deletes the pod and the attach/detach
		// controller detaches without waiting for an unmount.
		k.taintOutOfService(lost)
		k.waitFor("pod "+pod.Name+" gone", func() (bool, error) {
			_, err := s.CP.Client.CoreV1().Pods(testNS).Get(k.ctx(), pod.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err), nil
		})
		k.waitDetached(pv, lost)
		var other string
		for name, n := range s.Nodes {
			if name != lost && n.Spec.Server {
				other = name
			}
		}
		np := k.waitRunning(k.createPod("survivor", claim.Name, map[string]string{corev1.LabelHostname: other}))
		k.waitAttached(pv, other)
		if got := k.read(np, "data", len(data)); !bytes.Equal(got, data) {
			t.Errorf("after failover the volume reads %q..., want %q...", got[:16], data[:16])
		}
		if got := k.readAt(np, "data", len(more), 1<<20); !bytes.Equal(got, more) {
			t.Errorf("a write acknowledged on the lost node is gone: read %q..., want %q...", got[:16], more[:16])
		}
		pod = np
	})
	if t.Failed() {
		return
	}

	t.Run("SidecarLeaderFailover", func(t *testing.T) {
		k.t = t
		holders := k.leaseHolders()
		if len(holders) < 4 {
			t.Fatalf("lease holders %v: want the provisioner's, attacher's, resizer's and snapshotter's", holders)
		}
		// Each sidecar's leader is killed (the process, as a crash does);
		// the other pod's must take over.
		for lease, holder := range holders {
			cp := s.Controllers[holder]
			if cp == nil {
				t.Fatalf("lease %s is held by %q, not a csi-controller pod", lease, holder)
			}
			cp.Kill(sidecarOfLease(lease))
		}
		c := k.createClaim("after-failover", claimSize, nil)
		p := k.waitRunning(k.createPod("after-failover", c.Name, nil))
		k.expand(c.Name, "2Gi")
		sn := k.createSnapshot("after-failover", c.Name)
		k.waitSnapshotReady(sn)
		k.waitFor("every lease held by the other pod", func() (bool, error) {
			for lease, h := range k.leaseHolders() {
				if h == holders[lease] {
					return false, fmt.Errorf("%s still held by %s", lease, h)
				}
			}
			return true, nil
		})
		k.deletePod(p)
	})

	t.Run("StorLeaderKilledDuringProvisioning", func(t *testing.T) {
		k.t = t
		c := k.createClaim("leader-killed", claimSize, nil)
		p := k.createPod("leader-killed", c.Name, nil)
		// The scheduler has picked the node: the provisioner is about to
		// call CreateVolume (or is in it) when the stor leader dies.
		k.waitFor("claim "+c.Name+" given its selected node", func() (bool, error) {
			got, err := s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Get(k.ctx(), c.Name, metav1.GetOptions{})
			return err == nil && got.Annotations["volume.kubernetes.io/selected-node"] != "", err
		})
		leader := s.Stor.Leader(30 * time.Second)
		s.Stor.Kill(leader)
		p = k.waitRunning(p)
		payload := bytes.Repeat([]byte("leader"), 683)[:4096]
		k.write(p, "data", payload)
		if got := k.read(p, "data", len(payload)); !bytes.Equal(got, payload) {
			t.Errorf("read back %q..., want %q...", got[:12], payload[:12])
		}
		s.Stor.Start(leader)
	})
}

// k8sT holds the helpers of the scenarios.
type k8sT struct {
	t testing.TB
	s *k8stest.Stack
}

func (k *k8sT) ctx() context.Context { return context.Background() }

// waitFor polls cond until it holds; errors are remembered for the
// failure message.
func (k *k8sT) waitFor(what string, cond func() (bool, error)) {
	k.t.Helper()
	deadline := time.Now().Add(k8sWait)
	var last error
	for time.Now().Before(deadline) {
		k.s.Check()
		ok, err := cond()
		if ok {
			return
		}
		last = err
		time.Sleep(k8sPoll)
	}
	var kerr []string
	for name, n := range k.s.Nodes {
		kerr = append(kerr, fmt.Sprintf("%s: %v", name, n.Kubelet.Errors()))
	}
	var warnings []string
	if evs, err := k.s.CP.Client.CoreV1().Events("").List(k.ctx(), metav1.ListOptions{FieldSelector: "type=Warning"}); err == nil {
		for _, e := range evs.Items {
			warnings = append(warnings, fmt.Sprintf("%s %s/%s: %s: %s", e.InvolvedObject.Kind, e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Reason, e.Message))
		}
		if len(warnings) > 8 {
			warnings = warnings[len(warnings)-8:]
		}
	}
	k.t.Fatalf("waiting for %s: not within %v (last error: %v); kubelets: %s; last warning events:\n%s",
		what, k8sWait, last, strings.Join(kerr, "; "), strings.Join(warnings, "\n"))
}

func (k *k8sT) createClaim(name, size string, source *corev1.TypedLocalObjectReference) *corev1.PersistentVolumeClaim {
	k.t.Helper()
	c := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: ptr.To("stor"),
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
			DataSource:       source,
		},
	}
	c, err := k.s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Create(k.ctx(), c, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	return c
}

func (k *k8sT) createPod(name, claim string, nodeSelector map[string]string) *corev1.Pod {
	k.t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS},
		Spec: corev1.PodSpec{
			NodeSelector:                  nodeSelector,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.k8s.io/e2e-test-images/busybox:1.36.1-1"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
	p, err := k.s.CP.Client.CoreV1().Pods(testNS).Create(k.ctx(), p, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	return p
}

func (k *k8sT) waitRunning(p *corev1.Pod) *corev1.Pod {
	k.t.Helper()
	var got *corev1.Pod
	k.waitFor("pod "+p.Name+" running", func() (bool, error) {
		var err error
		got, err = k.s.CP.Client.CoreV1().Pods(p.Namespace).Get(k.ctx(), p.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if got.Spec.NodeName == "" {
			for _, c := range got.Status.Conditions {
				if c.Type == corev1.PodScheduled {
					return false, fmt.Errorf("unscheduled: %s: %s", c.Reason, c.Message)
				}
			}
		}
		return got.Status.Phase == corev1.PodRunning, nil
	})
	return got
}

func (k *k8sT) deletePod(p *corev1.Pod) {
	k.t.Helper()
	err := k.s.CP.Client.CoreV1().Pods(p.Namespace).Delete(k.ctx(), p.Name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		k.t.Fatal(err)
	}
	k.waitFor("pod "+p.Name+" deleted", func() (bool, error) {
		_, err := k.s.CP.Client.CoreV1().Pods(p.Namespace).Get(k.ctx(), p.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
}

func (k *k8sT) boundPV(claim string) *corev1.PersistentVolume {
	k.t.Helper()
	var pv *corev1.PersistentVolume
	k.waitFor("claim "+claim+" bound", func() (bool, error) {
		c, err := k.s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Get(k.ctx(), claim, metav1.GetOptions{})
		if err != nil || c.Status.Phase != corev1.ClaimBound {
			return false, err
		}
		pv, err = k.s.CP.Client.CoreV1().PersistentVolumes().Get(k.ctx(), c.Spec.VolumeName, metav1.GetOptions{})
		return err == nil, err
	})
	return pv
}

func (k *k8sT) attachment(pv *corev1.PersistentVolume, node string) (*bool, error) {
	l, err := k.s.CP.Client.StorageV1().VolumeAttachments().List(k.ctx(), metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, va := range l.Items {
		if va.Spec.NodeName == node && va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv.Name {
			return ptr.To(va.Status.Attached), nil
		}
	}
	return nil, nil
}

func (k *k8sT) waitAttached(pv *corev1.PersistentVolume, node string) {
	k.t.Helper()
	k.waitFor("VolumeAttachment of "+pv.Name+" to "+node+" attached", func() (bool, error) {
		a, err := k.attachment(pv, node)
		return a != nil && *a, err
	})
	if got := k.attachedNode(pv.Spec.CSI.VolumeHandle); got != node {
		k.t.Errorf("stor has %s attached to %q, the VolumeAttachment says %s", pv.Name, got, node)
	}
}

func (k *k8sT) waitDetached(pv *corev1.PersistentVolume, node string) {
	k.t.Helper()
	k.waitFor("VolumeAttachment of "+pv.Name+" to "+node+" gone", func() (bool, error) {
		a, err := k.attachment(pv, node)
		return a == nil && err == nil, err
	})
	if got := k.attachedNode(pv.Spec.CSI.VolumeHandle); got == node {
		k.t.Errorf("stor still has %s attached to %s after ControllerUnpublish", pv.Name, node)
	}
}

func (k *k8sT) volume(id string) *storpb.Volume {
	k.t.Helper()
	ctx, cancel := context.WithTimeout(k.ctx(), 30*time.Second)
	defer cancel()
	v, err := k.s.Stor.Client(k.anyServer()).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if err != nil {
		k.t.Fatalf("stor volume %s: %v", id, err)
	}
	return v.GetVolume()
}

func (k *k8sT) anyServer() int { return k.s.Stor.Leader(30 * time.Second) }

func (k *k8sT) attachedNode(id string) string { return k.volume(id).GetAttachment().GetNodeId() }

func (k *k8sT) volumeSize(id string) uint64 { return k.volume(id).GetSizeBytes() }

// replicaOn reports whether a replica of volume id is on the server of
// Kubernetes node node.
func (k *k8sT) replicaOn(id, node string) bool {
	for _, r := range k.volume(id).GetReplicas() {
		if k.s.ServerNode(r.GetServerId()) == node {
			return true
		}
	}
	return false
}

func (k *k8sT) device(p *corev1.Pod, vol string) (*k8stest.Node, int) {
	k.t.Helper()
	n := k.s.Nodes[p.Spec.NodeName]
	path, ok := n.Kubelet.Published(p.UID, vol)
	if !ok {
		k.t.Fatalf("pod %s's volume %s is not published on %s", p.Name, vol, p.Spec.NodeName)
	}
	dev, err := n.Plugin.DeviceOf(path)
	if err != nil {
		k.t.Fatal(err)
	}
	return n, dev
}

func (k *k8sT) write(p *corev1.Pod, vol string, data []byte) { k.writeAt(p, vol, data, dataOffset) }

func (k *k8sT) writeAt(p *corev1.Pod, vol string, data []byte, off uint64) {
	k.t.Helper()
	n, dev := k.device(p, vol)
	if err := n.Plugin.Kernel.WriteAt(dev, data, off); err != nil {
		k.t.Fatal(err)
	}
	if err := n.Plugin.Kernel.Flush(dev); err != nil {
		k.t.Fatal(err)
	}
}

func (k *k8sT) read(p *corev1.Pod, vol string, n int) []byte { return k.readAt(p, vol, n, dataOffset) }

func (k *k8sT) readAt(p *corev1.Pod, vol string, length int, off uint64) []byte {
	k.t.Helper()
	n, dev := k.device(p, vol)
	buf := make([]byte, length)
	if err := n.Plugin.Kernel.ReadAt(dev, buf, off); err != nil {
		k.t.Fatal(err)
	}
	return buf
}

func (k *k8sT) deviceSize(p *corev1.Pod, vol string) uint64 {
	n, dev := k.device(p, vol)
	return n.Plugin.Kernel.Size(dev)
}

func (k *k8sT) expand(claim, size string) {
	k.t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	if _, err := k.s.CP.Client.CoreV1().PersistentVolumeClaims(testNS).Patch(k.ctx(), claim, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		k.t.Fatal(err)
	}
}

func (k *k8sT) createSnapshot(name, claim string) string {
	k.t.Helper()
	o := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"name": name, "namespace": testNS},
		"spec": map[string]any{"volumeSnapshotClassName": "stor",
			"source": map[string]any{"persistentVolumeClaimName": claim}},
	}}
	if _, err := k.s.CP.Dynamic.Resource(snapshotGVR).Namespace(testNS).Create(k.ctx(), o, metav1.CreateOptions{}); err != nil {
		k.t.Fatal(err)
	}
	return name
}

func (k *k8sT) waitSnapshotReady(name string) {
	k.t.Helper()
	k.waitFor("VolumeSnapshot "+name+" ready", func() (bool, error) {
		o, err := k.s.CP.Dynamic.Resource(snapshotGVR).Namespace(testNS).Get(k.ctx(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		ready, _, _ := unstructured.NestedBool(o.Object, "status", "readyToUse")
		if msg, ok, _ := unstructured.NestedString(o.Object, "status", "error", "message"); ok {
			return ready, fmt.Errorf("%s", msg)
		}
		return ready, nil
	})
}

func (k *k8sT) taintOutOfService(node string) {
	k.t.Helper()
	if err := addOutOfServiceTaint(k.ctx(), k.s.CP.Client, node); err != nil {
		k.t.Fatal(err)
	}
}

// addOutOfServiceTaint adds the out-of-service taint to node, again on a
// fresh read when the update conflicts: the node lifecycle controller
// updates a node that stopped reporting at about the same moment (its
// NotReady condition, the unreachable taint), and an update of the copy
// read before it fails ("the object has been modified"; seen in make k8s).
func addOutOfServiceTaint(ctx context.Context, c kubernetes.Interface, node string) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		n, err := c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "node.kubernetes.io/out-of-service", Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute})
		_, err = c.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
}

// sidecarOfLease is the container whose leader-election Lease this is
// (the sidecars name their Leases after themselves and the driver; the
// provisioner's is the driver name alone).
func sidecarOfLease(lease string) string {
	for _, c := range []string{"attacher", "resizer", "snapshotter"} {
		if strings.Contains(lease, c) {
			return "csi-" + c
		}
	}
	return "csi-provisioner"
}

// leaseHolders are the holders of the sidecars' leader-election Leases in
// deploy/'s namespace, by Lease name (not stor-csi's own for PVC events:
// killing its holder, stor-csi, would take the pod's standby sidecars'
// driver with it, where a kubelet would restart the container).
func (k *k8sT) leaseHolders() map[string]string {
	k.t.Helper()
	l, err := k.s.CP.Client.CoordinationV1().Leases(k8stest.Namespace).List(k.ctx(), metav1.ListOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	out := map[string]string{}
	for _, le := range l.Items {
		if le.Name == pvcevents.LeaseName {
			continue // stor-csi's own (--pvc-events), not a sidecar's
		}
		if le.Spec.HolderIdentity != nil && *le.Spec.HolderIdentity != "" {
			out[le.Name] = *le.Spec.HolderIdentity
		}
	}
	return out
}
