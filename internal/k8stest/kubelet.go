package k8stest

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/mount-utils"
	"k8s.io/utils/ptr"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/attach/attachtest"
)

// Kubelet timing: how often the fake kubelet syncs its pods, renews its
// Lease and reports its status (the real kubelet: 10s lease renewal,
// status on change or every 5 minutes; faster here so tests run in
// seconds, well inside NodeMonitorGracePeriod).
const (
	syncInterval   = 300 * time.Millisecond
	leaseInterval  = 2 * time.Second
	statusInterval = 4 * time.Second
	leaseSeconds   = 40
	csiCallTimeout = 2 * time.Minute
)

// KubeletConfig describes one fake node.
type KubeletConfig struct {
	Name string
	Zone string
	// Driver is the node plugin's CSI endpoint ("unix:///...").
	Driver string
	// Root stands in for /var/lib/kubelet.
	Root string
	// Client has the node's credentials (ControlPlane.NodeConfig).
	Client *rest.Config
	Logger *slog.Logger
	// Registered, if set, runs once the Node is registered and before the
	// driver is asked anything: the node plugin may start there (its pod
	// exists only once the node does).
	Registered func(ctx context.Context) error
}

// Kubelet is a fake kubelet: what the real one does for stor's volumes
// and nothing else (no containers). See the package doc.
type Kubelet struct {
	cfg    KubeletConfig
	client kubernetes.Interface
	csi    csipb.NodeClient
	driver string // CSI driver name, from GetPluginInfo
	log    *slog.Logger

	mu      sync.Mutex
	pods    map[types.UID]*podState // pods this kubelet set up; guarded by mu
	inUse   []string                // volumesInUse last reported; guarded by mu
	errs    []string                // last errors per pod, for test failures; guarded by mu
	stopped bool

	cancel context.CancelFunc
	done   chan struct{}
}

type podState struct {
	pod     *corev1.Pod
	volumes map[string]*mounted // by pod volume name
	running bool
}

// mounted is one CSI volume of a pod on this node.
type mounted struct {
	pvc, pv string
	handle  string
	staging string
	target  string
	caps    *csipb.VolumeCapability
	// published: NodePublish succeeded.
	published bool
}

// StartKubelet registers the node and starts its loops. It returns once
// the node is registered and its CSINode written.
func StartKubelet(t testing.TB, cfg KubeletConfig) *Kubelet {
	t.Helper()
	cl, err := kubernetes.NewForConfig(cfg.Client)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := dialCSI(cfg.Driver)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	k := &Kubelet{cfg: cfg, client: cl, csi: csipb.NewNodeClient(conn), log: cfg.Logger.With("kubelet", cfg.Name),
		pods: map[types.UID]*podState{}, done: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := k.register(ctx); err != nil {
		t.Fatalf("kubelet %s: register: %v", cfg.Name, err)
	}
	if cfg.Registered != nil {
		if err := cfg.Registered(ctx); err != nil {
			t.Fatalf("kubelet %s: %v", cfg.Name, err)
		}
	}
	info, err := csipb.NewIdentityClient(conn).GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{})
	if err != nil {
		t.Fatalf("kubelet %s: GetPluginInfo: %v", cfg.Name, err)
	}
	k.driver = info.GetName()
	if err := k.registerDriver(ctx); err != nil {
		t.Fatalf("kubelet %s: %v", cfg.Name, err)
	}
	runCtx, runCancel := context.WithCancel(context.Background())
	k.cancel = runCancel
	go k.run(runCtx)
	t.Cleanup(k.Stop)
	return k
}

// Stop stops the kubelet as a node that died does: no heartbeat, no
// more syncs, nothing unmounted.
func (k *Kubelet) Stop() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	k.stopped = true
	k.mu.Unlock()
	k.cancel()
	<-k.done
}

// Errors are the kubelet's most recent sync errors (for failure messages).
func (k *Kubelet) Errors() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.errs...)
}

func (k *Kubelet) register(ctx context.Context) error {
	labels := map[string]string{
		corev1.LabelHostname: k.cfg.Name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
	}
	if k.cfg.Zone != "" {
		labels[corev1.LabelTopologyZone] = k.cfg.Zone
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("32Gi"),
		corev1.ResourcePods: resource.MustParse("110"),
	}
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: k.cfg.Name, Labels: labels,
			// The attach/detach controller attaches for this node (the
			// kubelet's default, --enable-controller-attach-detach).
			Annotations: map[string]string{"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
		},
	}
	if _, err := k.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return err
	}
	// The node lifecycle controller taints a new Node at once: retry on
	// a conflict, as every kubelet status update does, and on
	// NodeRestriction's refusal to "modify taints", which is what a taint
	// added between the Get and the update looks like (admission compares
	// the taints before storage sees the stale resourceVersion).
	staleTaints := func(err error) bool {
		return apierrors.IsConflict(err) || (apierrors.IsForbidden(err) && strings.Contains(err.Error(), "taints"))
	}
	err := retry.OnError(retry.DefaultBackoff, staleTaints, func() error {
		n, err := k.client.CoreV1().Nodes().Get(ctx, k.cfg.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Status = corev1.NodeStatus{
			Capacity: capacity, Allocatable: capacity,
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}, {Type: corev1.NodeHostName, Address: k.cfg.Name}},
			NodeInfo:  corev1.NodeSystemInfo{KubeletVersion: "v1.37.2", OperatingSystem: "linux", Architecture: "amd64"},
		}
		setReady(n)
		_, err = k.client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return err
	}
	return k.renewLease(ctx)
}

func setReady(n *corev1.Node) {
	now := metav1.Now()
	cond := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		Message: "k8stest fake kubelet", LastHeartbeatTime: now, LastTransitionTime: now}
	for i, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status == corev1.ConditionTrue {
				cond.LastTransitionTime = c.LastTransitionTime
			}
			n.Status.Conditions[i] = cond
			return
		}
	}
	n.Status.Conditions = append(n.Status.Conditions, cond)
}

func (k *Kubelet) renewLease(ctx context.Context) error {
	leases := k.client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	l, err := leases.Get(ctx, k.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: k.cfg.Name, Namespace: corev1.NamespaceNodeLease},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(k.cfg.Name), LeaseDurationSeconds: ptr.To[int32](leaseSeconds),
				RenewTime: &now},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	l.Spec.RenewTime = &now
	_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	return err
}

// registerDriver does what the kubelet does when node-driver-registrar
// registers a CSI driver: NodeGetInfo, then the node's topology labels and
// csi.volume.kubernetes.io/nodeid annotation (as the node itself, so
// NodeRestriction judges the labels), then CSINode.
func (k *Kubelet) registerDriver(ctx context.Context) error {
	info, err := k.csi.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
	if err != nil {
		return fmt.Errorf("NodeGetInfo: %w", err)
	}
	seg := info.GetAccessibleTopology().GetSegments()
	var node *corev1.Node
	err = retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		var err error
		if node, err = k.client.CoreV1().Nodes().Get(ctx, k.cfg.Name, metav1.GetOptions{}); err != nil {
			return err
		}
		ids := map[string]string{}
		if a := node.Annotations["csi.volume.kubernetes.io/nodeid"]; a != "" {
			if err := json.Unmarshal([]byte(a), &ids); err != nil {
				return err
			}
		}
		ids[k.driver] = info.GetNodeId()
		b, err := json.Marshal(ids)
		if err != nil {
			return err
		}
		// A merge patch of the annotation and the labels, as the real
		// kubelet patches its Node: an Update would carry the taints it
		// read, and NodeRestriction forbids it ("not allowed to modify
		// taints") when the node lifecycle controller changed them
		// since, before any conflict is seen.
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
			"annotations": map[string]string{"csi.volume.kubernetes.io/nodeid": string(b)},
			"labels":      seg,
		}})
		if err != nil {
			return err
		}
		node, err = k.client.CoreV1().Nodes().Patch(ctx, k.cfg.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("the kubelet could not record driver %s's topology on Node %s (as the real kubelet's plugin registration would fail): %w", k.driver, k.cfg.Name, err)
	}
	keys := make([]string, 0, len(seg))
	for key := range seg {
		keys = append(keys, key)
	}
	slices.Sort(keys)
	drv := storagev1.CSINodeDriver{Name: k.driver, NodeID: info.GetNodeId(), TopologyKeys: keys}
	if m := info.GetMaxVolumesPerNode(); m > 0 {
		drv.Allocatable = &storagev1.VolumeNodeResources{Count: ptr.To(int32(m))}
	}
	_, err = k.client.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: k.cfg.Name, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}}},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{drv}},
	}, metav1.CreateOptions{})
	return err
}

func (k *Kubelet) run(ctx context.Context) {
	defer close(k.done)
	syncs := time.NewTicker(syncInterval)
	defer syncs.Stop()
	lease := time.NewTicker(leaseInterval)
	defer lease.Stop()
	status := time.NewTicker(statusInterval)
	defer status.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-lease.C:
			if err := k.renewLease(ctx); err != nil && ctx.Err() == nil {
				k.log.Warn("lease renewal failed", "err", err)
			}
		case <-status.C:
			if err := k.updateStatus(ctx, nil); err != nil && ctx.Err() == nil {
				k.log.Warn("status update failed", "err", err)
			}
		case <-syncs.C:
			k.sync(ctx)
		}
	}
}

// updateStatus renews the Ready condition and, if inUse is not nil,
// reports those volumes in use.
func (k *Kubelet) updateStatus(ctx context.Context, inUse []string) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		node, err := k.client.CoreV1().Nodes().Get(ctx, k.cfg.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		setReady(node)
		if inUse != nil {
			node.Status.VolumesInUse = nil
			for _, v := range inUse {
				node.Status.VolumesInUse = append(node.Status.VolumesInUse, corev1.UniqueVolumeName(v))
			}
		}
		_, err = k.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
}

func (k *Kubelet) sync(ctx context.Context) {
	pods, err := k.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", k.cfg.Name).String()})
	if err != nil {
		return
	}
	var errs []string
	seen := map[types.UID]bool{}
	for i := range pods.Items {
		p := &pods.Items[i]
		seen[p.UID] = true
		if err := k.syncPod(ctx, p); err != nil {
			errs = append(errs, fmt.Sprintf("%s/%s: %v", p.Namespace, p.Name, err))
		}
	}
	// Pods deleted from the API without this kubelet (force deletion):
	// tear their volumes down as the kubelet does for orphans.
	k.mu.Lock()
	var gone []*podState
	for uid, st := range k.pods {
		if !seen[uid] {
			gone = append(gone, st)
		}
	}
	k.mu.Unlock()
	for _, st := range gone {
		if err := k.teardown(ctx, st); err != nil {
			errs = append(errs, fmt.Sprintf("orphan %s: %v", st.pod.Name, err))
			continue
		}
		k.mu.Lock()
		delete(k.pods, st.pod.UID)
		k.mu.Unlock()
	}
	if err := k.reportInUse(ctx); err != nil {
		errs = append(errs, "volumesInUse: "+err.Error())
	}
	k.mu.Lock()
	k.errs = errs
	k.mu.Unlock()
}

// reportInUse reports the unique names of every volume of this node's pods.
func (k *Kubelet) reportInUse(ctx context.Context) error {
	k.mu.Lock()
	var inUse []string
	for _, st := range k.pods {
		for _, m := range st.volumes {
			inUse = append(inUse, "kubernetes.io/csi/"+k.driver+"^"+m.handle)
		}
	}
	slices.Sort(inUse)
	inUse = slices.Compact(inUse)
	same := slices.Equal(inUse, k.inUse) && k.inUse != nil
	k.mu.Unlock()
	if same {
		return nil
	}
	if inUse == nil {
		inUse = []string{}
	}
	if err := k.updateStatus(ctx, inUse); err != nil {
		return err
	}
	k.mu.Lock()
	k.inUse = inUse
	k.mu.Unlock()
	return nil
}

func (k *Kubelet) syncPod(ctx context.Context, p *corev1.Pod) error {
	k.mu.Lock()
	st := k.pods[p.UID]
	if st == nil {
		st = &podState{pod: p, volumes: map[string]*mounted{}}
		k.pods[p.UID] = st
	}
	st.pod = p
	k.mu.Unlock()
	if p.DeletionTimestamp != nil {
		if err := k.teardown(ctx, st); err != nil {
			return err
		}
		err := k.client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
			GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &p.UID}})
		if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		k.mu.Lock()
		delete(k.pods, p.UID)
		k.mu.Unlock()
		return nil
	}
	if err := k.setup(ctx, st); err != nil {
		return err
	}
	if err := k.expand(ctx, st); err != nil {
		return err
	}
	if !st.running {
		if err := k.markRunning(ctx, p); err != nil {
			return err
		}
		st.running = true
	}
	return nil
}

// setup stages and publishes every CSI volume of the pod that is
// attached; it returns an error naming what it waits for otherwise.
func (k *Kubelet) setup(ctx context.Context, st *podState) error {
	p := st.pod
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		m := st.volumes[v.Name]
		if m == nil {
			pvc, err := k.client.CoreV1().PersistentVolumeClaims(p.Namespace).Get(ctx, v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if pvc.Spec.VolumeName == "" || pvc.Status.Phase != corev1.ClaimBound {
				return fmt.Errorf("claim %s not bound", pvc.Name)
			}
			pv, err := k.client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != k.driver {
				continue
			}
			m = &mounted{pvc: pvc.Name, pv: pv.Name, handle: pv.Spec.CSI.VolumeHandle,
				staging: filepath.Join(k.cfg.Root, "plugins/kubernetes.io/csi", k.driver,
					fmt.Sprintf("%x", sha256.Sum256([]byte(pv.Spec.CSI.VolumeHandle))), "globalmount"),
				target: filepath.Join(k.cfg.Root, "pods", string(p.UID), "volumes/kubernetes.io~csi", pv.Name, "mount"),
				caps:   capability(pv)}
			k.mu.Lock()
			st.volumes[v.Name] = m
			k.mu.Unlock()
		}
		if m.published {
			continue
		}
		if err := k.publish(ctx, m, v.PersistentVolumeClaim.ReadOnly); err != nil {
			return err
		}
	}
	return nil
}

func capability(pv *corev1.PersistentVolume) *csipb.VolumeCapability {
	mode := csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	if slices.Contains(pv.Spec.AccessModes, corev1.ReadWriteOncePod) {
		mode = csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
	}
	c := &csipb.VolumeCapability{AccessMode: &csipb.VolumeCapability_AccessMode{Mode: mode}}
	if pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == corev1.PersistentVolumeBlock {
		c.AccessType = &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{FsType: pv.Spec.CSI.FSType}}
	}
	return c
}

// attachmentName is the attach/detach controller's VolumeAttachment name.
func attachmentName(handle, driver, node string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(handle+driver+node)))
}

func (k *Kubelet) publish(ctx context.Context, m *mounted, readOnly bool) error {
	// The kubelet waits for the attach/detach controller to report the
	// volume attached to this node, then reads the publish context from
	// the VolumeAttachment.
	node, err := k.client.CoreV1().Nodes().Get(ctx, k.cfg.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	unique := corev1.UniqueVolumeName("kubernetes.io/csi/" + k.driver + "^" + m.handle)
	if !slices.ContainsFunc(node.Status.VolumesAttached, func(a corev1.AttachedVolume) bool { return a.Name == unique }) {
		return fmt.Errorf("volume %s not yet attached to %s", m.pv, k.cfg.Name)
	}
	va, err := k.client.StorageV1().VolumeAttachments().Get(ctx, attachmentName(m.handle, k.driver, k.cfg.Name), metav1.GetOptions{})
	if err != nil {
		return err
	}
	if !va.Status.Attached {
		return fmt.Errorf("VolumeAttachment %s not attached", va.Name)
	}
	pv, err := k.client.CoreV1().PersistentVolumes().Get(ctx, m.pv, metav1.GetOptions{})
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, csiCallTimeout)
	defer cancel()
	if err := os.MkdirAll(m.staging, 0o750); err != nil {
		return err
	}
	if _, err := k.csi.NodeStageVolume(cctx, &csipb.NodeStageVolumeRequest{
		VolumeId: m.handle, PublishContext: va.Status.AttachmentMetadata, StagingTargetPath: m.staging,
		VolumeCapability: m.caps, VolumeContext: pv.Spec.CSI.VolumeAttributes,
	}); err != nil {
		return fmt.Errorf("NodeStageVolume %s: %w", m.pv, err)
	}
	if err := os.MkdirAll(filepath.Dir(m.target), 0o750); err != nil {
		return err
	}
	if _, err := k.csi.NodePublishVolume(cctx, &csipb.NodePublishVolumeRequest{
		VolumeId: m.handle, PublishContext: va.Status.AttachmentMetadata, StagingTargetPath: m.staging,
		TargetPath: m.target, VolumeCapability: m.caps, Readonly: readOnly, VolumeContext: pv.Spec.CSI.VolumeAttributes,
	}); err != nil {
		return fmt.Errorf("NodePublishVolume %s: %w", m.pv, err)
	}
	m.published = true
	return nil
}

// teardown unpublishes the pod's volumes, and unstages each that no
// other pod of this node uses.
func (k *Kubelet) teardown(ctx context.Context, st *podState) error {
	cctx, cancel := context.WithTimeout(ctx, csiCallTimeout)
	defer cancel()
	for name, m := range st.volumes {
		if _, err := k.csi.NodeUnpublishVolume(cctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: m.handle, TargetPath: m.target}); err != nil {
			return fmt.Errorf("NodeUnpublishVolume %s: %w", m.pv, err)
		}
		if !k.usedByOthers(st, m.handle) {
			if _, err := k.csi.NodeUnstageVolume(cctx, &csipb.NodeUnstageVolumeRequest{VolumeId: m.handle, StagingTargetPath: m.staging}); err != nil {
				return fmt.Errorf("NodeUnstageVolume %s: %w", m.pv, err)
			}
		}
		k.mu.Lock()
		delete(st.volumes, name)
		k.mu.Unlock()
	}
	return nil
}

func (k *Kubelet) usedByOthers(st *podState, handle string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, o := range k.pods {
		if o == st {
			continue
		}
		for _, m := range o.volumes {
			if m.handle == handle && m.published {
				return true
			}
		}
	}
	return false
}

// expand finishes an expansion the resizer left to the node
// (allocatedResourceStatuses NodeResizePending): NodeExpandVolume, then
// the claim's status capacity, as the kubelet's volume manager does.
func (k *Kubelet) expand(ctx context.Context, st *podState) error {
	for _, m := range st.volumes {
		if !m.published {
			continue
		}
		pvc, err := k.client.CoreV1().PersistentVolumeClaims(st.pod.Namespace).Get(ctx, m.pvc, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] != corev1.PersistentVolumeClaimNodeResizePending {
			continue
		}
		pv, err := k.client.CoreV1().PersistentVolumes().Get(ctx, m.pv, metav1.GetOptions{})
		if err != nil {
			return err
		}
		size := pv.Spec.Capacity[corev1.ResourceStorage]
		cctx, cancel := context.WithTimeout(ctx, csiCallTimeout)
		_, err = k.csi.NodeExpandVolume(cctx, &csipb.NodeExpandVolumeRequest{
			VolumeId: m.handle, VolumePath: m.target, StagingTargetPath: m.staging, VolumeCapability: m.caps,
			CapacityRange: &csipb.CapacityRange{RequiredBytes: size.Value()},
		})
		cancel()
		if err != nil {
			return fmt.Errorf("NodeExpandVolume %s: %w", m.pv, err)
		}
		pvc.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: size}
		delete(pvc.Status.AllocatedResourceStatuses, corev1.ResourceStorage)
		pvc.Status.Conditions = slices.DeleteFunc(pvc.Status.Conditions, func(c corev1.PersistentVolumeClaimCondition) bool {
			return c.Type == corev1.PersistentVolumeClaimFileSystemResizePending || c.Type == corev1.PersistentVolumeClaimResizing
		})
		if _, err := k.client.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("claim %s status after NodeExpandVolume: %w", pvc.Name, err)
		}
	}
	return nil
}

func (k *Kubelet) markRunning(ctx context.Context, p *corev1.Pod) error {
	now := metav1.Now()
	p = p.DeepCopy()
	p.Status.Phase = corev1.PodRunning
	p.Status.HostIP, p.Status.PodIP = "127.0.0.1", "127.0.0.1"
	p.Status.StartTime = &now
	p.Status.Conditions = nil
	for _, c := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	p.Status.ContainerStatuses = nil
	for _, c := range p.Spec.Containers {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: "k8stest://" + c.Image, Ready: true, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}})
	}
	_, err := k.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	return err
}

// Published is the publish path of the pod's volume vol, once
// NodePublishVolume succeeded for it.
func (k *Kubelet) Published(podUID types.UID, vol string) (string, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	st := k.pods[podUID]
	if st == nil || st.volumes[vol] == nil || !st.volumes[vol].published {
		return "", false
	}
	return st.volumes[vol].target, true
}

// ---------------------------------------------------------------- node plugin

// NodePlugin is a stor-csi node plugin in this process with a fake
// kernel (attachtest) and mount-utils' fake mounter.
type NodePlugin struct {
	Endpoint string
	Kernel   *attachtest.Kernel
	Mounter  *mount.FakeMounter
	cancel   context.CancelFunc
	done     chan error
}

// StartNodePlugin runs a node plugin for node name in zone with the
// cluster's control addresses.
func StartNodePlugin(t testing.TB, dir, name, zone string, cluster csi.Cluster, dataDial func(ctx context.Context, network, addr string) (net.Conn, error), logger *slog.Logger) *NodePlugin {
	t.Helper()
	kern := attachtest.NewKernel()
	mounter := mount.NewFakeMounter(nil)
	sizeOf := func(dev string) (int64, error) {
		i, err := strconv.Atoi(strings.TrimPrefix(dev, "/dev/nbd"))
		if err != nil {
			return 0, fmt.Errorf("k8stest: %s is not an nbd device", dev)
		}
		return int64(kern.Size(i)), nil
	}
	host := &csi.Host{
		Mounter: mounter, FormatAndMount: mounter.Mount,
		ResizeFS:   func(string, string) error { return nil },
		DeviceSize: sizeOf,
	}
	sock := filepath.Join(dir, "csi.sock")
	cfg := csi.DefaultConfig()
	cfg.Mode, cfg.Endpoint, cfg.NodeID, cfg.Zone = csi.ModeNode, "unix://"+sock, name, zone
	cfg.StateDir, cfg.Cluster, cfg.Host, cfg.Logger = filepath.Join(dir, "state"), cluster, host, logger
	cfg.DataDial = dataDial
	cfg.Attacher = csi.NewKernelAttacher(csi.KernelAttacherConfig{
		StateDir: filepath.Join(dir, "state"), NodeID: name, Cluster: cluster, Kernel: kern.Ops(), Logger: logger, DataDial: dataDial})
	d, err := csi.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	np := &NodePlugin{Endpoint: "unix://" + sock, Kernel: kern, Mounter: mounter, cancel: cancel, done: make(chan error, 1)}
	go func() { np.done <- d.Run(ctx) }()
	t.Cleanup(np.Stop)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			return np
		}
		if time.Now().After(deadline) {
			t.Fatalf("k8stest: node plugin %s did not listen within 10s", name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop stops the node plugin (idempotent).
func (np *NodePlugin) Stop() {
	if np.cancel == nil {
		return
	}
	np.cancel()
	np.cancel = nil
	<-np.done
}

// DeviceOf is the fake device index of a mounted path (the publish or
// staging path), following the fake mounter's bind mounts.
func (np *NodePlugin) DeviceOf(path string) (int, error) {
	for range 4 {
		mps, err := np.Mounter.List()
		if err != nil {
			return 0, err
		}
		i := slices.IndexFunc(mps, func(m mount.MountPoint) bool { return m.Path == path })
		if i < 0 {
			return 0, fmt.Errorf("k8stest: %s is not mounted", path)
		}
		dev := mps[i].Device
		if n, ok := strings.CutPrefix(dev, "/dev/nbd"); ok {
			return strconv.Atoi(n)
		}
		path = dev // a bind mount of the staging path
	}
	return 0, errors.New("k8stest: mount chain too long")
}
