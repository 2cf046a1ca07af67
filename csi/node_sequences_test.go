package csi

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	mount "k8s.io/mount-utils"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/internal/attach/attachtest"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/nbd/kernel"
)

// The sequences a node plugin meets around a stage: a fence by the
// controller while the volume is staged, a busy device at unstage, a stop
// or a node call during start-up recovery, a failed repeated stage, a
// recovery that fails. Each node "process" is a Driver with the real
// kernel attacher on a fake kernel (attachtest) shared by all of them, as
// the node's kernel is, and a 3-server cluster.

type nodeEnv struct {
	c    *servertest.Cluster
	cl   *client.Client
	kern *attachtest.Kernel
	dir  string
	node string
}

func newNodeEnv(t *testing.T) *nodeEnv {
	t.Helper()
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	return &nodeEnv{c: c, cl: clusterClient(t, c), kern: attachtest.NewKernel(), dir: t.TempDir(), node: c.Nodes[0].ID}
}

func (e *nodeEnv) attachDir() string { return filepath.Join(e.dir, "state", "nbd") }

// testCtx is a test's context: 90 s.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// driver starts a node plugin process on the node's state dir and kernel;
// ops (nil: the kernel as it is) and volumes (nil: the cluster's) may be
// wrapped by a test.
func (e *nodeEnv) driver(t *testing.T, ops *attach.Kernel, volumes storpb.VolumeServiceClient) *Driver {
	t.Helper()
	if volumes == nil {
		volumes = e.cl.Volumes
	}
	return e.driverOn(t, ops, Cluster{Cluster: e.cl.Cluster, Volumes: volumes, Snapshots: e.cl.Snapshots})
}

// driverOn is driver with the cluster's clients as given.
func (e *nodeEnv) driverOn(t *testing.T, ops *attach.Kernel, cluster Cluster) *Driver {
	t.Helper()
	if ops == nil {
		ops = e.kern.Ops()
	}
	att := NewKernelAttacher(KernelAttacherConfig{StateDir: e.attachDir(), NodeID: e.node,
		Cluster: cluster, Kernel: ops, Logger: testLogger(t)})
	m := mount.NewFakeMounter(nil)
	host := &Host{Mounter: m, FormatAndMount: m.Mount, ResizeFS: func(string, string) error { return nil },
		DeviceSize: func(string) (int64, error) { return 0, nil }}
	d, err := New(Config{Mode: ModeNode, NodeID: e.node, StateDir: filepath.Join(e.dir, "state"),
		Cluster: cluster, Attacher: att, Host: host, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// volume creates a volume and attaches it to the node, as
// ControllerPublishVolume does.
func (e *nodeEnv) volume(t *testing.T, ctx context.Context, name string) string {
	t.Helper()
	v, err := e.cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: 16 << 20, ReplicaCount: 3})
	if err != nil {
		t.Fatal(err)
	}
	id := v.GetVolume().GetId()
	e.controllerPublish(t, ctx, id)
	return id
}

func (e *nodeEnv) controllerPublish(t *testing.T, ctx context.Context, id string) {
	t.Helper()
	if _, err := e.cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: e.node,
		Mode: storpb.AccessMode_ACCESS_MODE_READ_WRITE}); err != nil {
		t.Fatal(err)
	}
}

// connected is the backend the kernel has device dev connected for ("" if
// none).
func (e *nodeEnv) connected(dev string) string {
	i, err := kernel.ParseDevice(dev)
	if err != nil {
		return ""
	}
	b, _ := e.kern.Ops().Backend(i)
	return b
}

func stageRequest(id, staging string) *csipb.NodeStageVolumeRequest {
	return &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: rwoCap(),
		PublishContext: map[string]string{ctxReadOnly: "false"}}
}

// stagedByADeadPlugin makes a volume, stages it (block, or mount with
// mountCap when mounted) with a plugin process that then dies, leaving
// device and record for the next: the volume's id, device and staging
// path.
func (e *nodeEnv) stagedByADeadPlugin(t *testing.T, ctx context.Context, name string, mounted bool) (id, dev, staging string) {
	t.Helper()
	id = e.volume(t, ctx, name)
	d := e.driver(t, nil, nil)
	staging = filepath.Join(e.dir, "staging-"+name)
	req := stageRequest(id, staging)
	if mounted {
		req.VolumeCapability = mountCap()
	}
	if _, err := d.node.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	dev, _, _ = d.node.attacher.Served(id)
	d.Close()
	return id, dev, staging
}

// forceDetach detaches volume id from the node, as ControllerUnpublish
// does once a node was NotReady long enough, and waits until d's engine
// of it is fenced and stopped.
func (e *nodeEnv) forceDetach(t *testing.T, ctx context.Context, d *Driver, id string) {
	t.Helper()
	if _, err := e.cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: e.node}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, _, ok := d.node.attacher.Served(id); !ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the engine was not fenced by the detach within 20 s")
		}
	}
}

// staleMount makes staging, staged by d, a mount of another device than
// the one it was mounted from: after a fence the old mount stays on the
// old device, whose index a real kernel does not give out again while it
// is mounted (the fake one would). It returns d's mounter.
func staleMount(t *testing.T, d *Driver, staging string) *mount.FakeMounter {
	t.Helper()
	m := d.node.host.Mounter.(*mount.FakeMounter)
	if err := m.Unmount(staging); err != nil {
		t.Fatal(err)
	}
	if err := m.Mount("/dev/nbd7", staging, "ext4", nil); err != nil {
		t.Fatal(err)
	}
	return m
}

// mountedFromServed fails the test unless volume id is served by d and
// staging is mounted (in m) from its device, which it returns.
func mountedFromServed(t *testing.T, d *Driver, m *mount.FakeMounter, id, staging string) string {
	t.Helper()
	dev, _, ok := d.node.attacher.Served(id)
	if !ok {
		t.Fatalf("volume %s is not served", id)
	}
	from, _, err := mount.GetDeviceNameFromMount(m, staging)
	if err != nil {
		t.Fatal(err)
	}
	if from != dev {
		t.Fatalf("the staging path is mounted from %s; the volume is served on %s", from, dev)
	}
	return dev
}

// stageMount stages volume id with d as a mount volume at staging, and
// returns the request.
func stageMount(t *testing.T, ctx context.Context, d *Driver, id, staging string) *csipb.NodeStageVolumeRequest {
	t.Helper()
	req := stageRequest(id, staging)
	req.VolumeCapability = mountCap()
	if _, err := d.node.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	return req
}

func stage(t *testing.T, ctx context.Context, d *Driver, id, staging string) string {
	t.Helper()
	if _, err := d.node.NodeStageVolume(ctx, stageRequest(id, staging)); err != nil {
		t.Fatal(err)
	}
	dev, _, ok := d.node.attacher.Served(id)
	if !ok {
		t.Fatalf("volume %s staged but not served", id)
	}
	return dev
}

// A volume the controller detaches while it is staged here (a force
// detach after a node was NotReady) fences the engine here, which stopped
// and left its device connected without a server, requests it had not
// answered still in the kernel, and NodeUnstage succeeded leaving device
// and record: the volume's next stage on this node resumed that device,
// and the kernel resent those requests, written by the fenced engine, over
// what the volume's next holder wrote meanwhile. Now the fenced stop
// disconnects the device and drops its record, a block publish of the
// volume is refused meanwhile, and the next stage attaches a new device.
func TestAFencedVolumesDeviceIsNeverResumed(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "fenced")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	dev := stage(t, ctx, d, id, staging)
	e.forceDetach(t, ctx, d, id)
	rec, err := attach.LoadRecord(e.attachDir(), id)
	if err != nil {
		t.Fatal(err)
	}
	if b := e.connected(dev); b != "" || rec != nil {
		t.Fatalf("the fenced stop left %s connected for %q (attach record kept: %v)", dev, b, rec != nil)
	}
	// Nor may a pod be given the device now: nothing serves it.
	_, err = d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: filepath.Join(e.dir, "pod", "dev"), VolumeCapability: rwoCap()})
	if !errors.Is(err, ErrPrecondition) {
		t.Fatalf("a block publish of the fenced volume from %s: %v, want ErrPrecondition", dev, err)
	}
	// Back to this node without an unstage between: a new device.
	e.controllerPublish(t, ctx, id)
	if _, err := d.node.NodeStageVolume(ctx, stageRequest(id, staging)); err != nil {
		t.Fatal(err)
	}
	if at := d.node.attacher.(*kernelAttacher).served[id].at; at.Resumed() {
		t.Fatal("the next stage resumed the device left by the fenced engine")
	}
	if _, err := d.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
}

// A plugin that died (its device and record left, requests perhaps still
// in the device) while the controller detached its volume, which another
// node then wrote, must not resume that device when the volume comes back
// to this node: the kernel would resend the dead engine's requests over
// the other node's writes. The record's epoch is the volume's no longer.
func TestADeviceLeftAtAnOlderEpochIsNotResumed(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id, dev, _ := e.stagedByADeadPlugin(t, ctx, "moved", false)
	// ControllerUnpublish, another node, then back to this one.
	if _, err := e.cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: e.node}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: "other-node",
		Mode: storpb.AccessMode_ACCESS_MODE_READ_WRITE}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: "other-node"}); err != nil {
		t.Fatal(err)
	}
	e.controllerPublish(t, ctx, id)

	d2 := e.driver(t, nil, nil)
	defer d2.Close()
	if err := d2.node.recover(ctx); err != nil {
		t.Fatal(err)
	}
	s := d2.node.attacher.(*kernelAttacher).served[id]
	if s == nil {
		t.Fatal("not recovered")
	}
	if s.at.Resumed() {
		t.Fatalf("the recovery resumed %s, left at an epoch the volume has left", dev)
	}
}

// A NodeUnstage that the kubelet retries right after a restart, before the
// recovery got to the volume, must not wait for the recovery while the
// recovery waits for it: its unmount writes the filesystem back to the
// device, which nothing serves until the volume is recovered. The recovery
// waited for the unstage's lock, so neither went on, nor did the recovery
// of any volume after it.
func TestAnUnstageDuringRecoveryServesTheVolumeForItsUnmount(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id1, id2 := e.volume(t, ctx, "first"), e.volume(t, ctx, "second")
	if id1 > id2 {
		id1, id2 = id2, id1 // recovery takes them in this order
	}
	d1 := e.driver(t, nil, nil)
	st1, st2 := filepath.Join(e.dir, "staging1"), filepath.Join(e.dir, "staging2")
	stageMount(t, ctx, d1, id1, st1)
	stageMount(t, ctx, d1, id2, st2)
	dev1, _, _ := d1.node.attacher.Served(id1)
	dev2, _, _ := d1.node.attacher.Served(id2)
	d1.Close()

	d2 := e.driver(t, nil, nil)
	defer d2.Close()
	m := mount.NewFakeMounter([]mount.MountPoint{{Device: dev1, Path: st1}, {Device: dev2, Path: st2}})
	// The unmount writes back: it ends once the device is served, or
	// fails after 8 s (a real one waits the kernel's dead-connection
	// timeout, or for ever for requests already in flight).
	m.UnmountFunc = func(string) error {
		for deadline := time.Now().Add(8 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if _, _, ok := d2.node.attacher.Served(id1); ok {
				return nil
			}
		}
		return errors.New("umount: I/O error (nothing served the device)")
	}
	d2.node.host.Mounter = m
	unstaged := make(chan error, 1)
	go func() {
		_, err := d2.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id1, StagingTargetPath: st1})
		unstaged <- err
	}()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	recovered := make(chan error, 1)
	go func() { recovered <- d2.node.recover(ctx) }()
	if err := <-unstaged; err != nil {
		t.Fatalf("NodeUnstage during the recovery: %v", err)
	}
	if err := <-recovered; err != nil {
		t.Fatalf("recovery: %v", err)
	}
	if took := time.Since(start); took > 4*time.Second {
		t.Fatalf("the unstage and the recovery took %v: one waited for the other", took)
	}
	if _, _, ok := d2.node.attacher.Served(id2); !ok {
		t.Fatal("the other volume was not recovered")
	}
	if _, _, ok := d2.node.attacher.Served(id1); ok {
		t.Fatal("the unstaged volume is served after the recovery")
	}
}

// A NodeUnstage that finds the device in use (a mount of it leaked into
// another mount namespace, say) fails, and so must every retry of it while
// the device stays in use: the second try used to succeed, the device
// still connected and held, and ControllerUnpublish could then hand the
// volume to another node.
func TestUnstageRetriedWhileTheDeviceIsInUseFails(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "busy")
	ops := e.kern.Ops()
	var busy atomic.Bool
	busy.Store(true)
	open := ops.OpenExclusive
	ops.OpenExclusive = func(i int) (attach.SyncCloser, error) {
		if busy.Load() {
			return nil, fmt.Errorf("/dev/nbd%d: %w", i, kernel.ErrBusy)
		}
		return open(i)
	}
	d := e.driver(t, ops, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	dev := stage(t, ctx, d, id, staging)
	unstage := &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}
	for try := 1; try <= 3; try++ {
		_, err := d.node.NodeUnstageVolume(ctx, unstage)
		if err == nil {
			t.Fatalf("NodeUnstage try %d succeeded while %s is in use (connected for %q)", try, dev, e.connected(dev))
		}
		if !errors.Is(err, attach.ErrInUse) {
			t.Fatalf("NodeUnstage try %d: %v, want ErrInUse", try, err)
		}
		if rec, _ := d.node.load(id); rec == nil {
			t.Fatalf("NodeUnstage try %d failed but removed the staged record", try)
		}
	}
	busy.Store(false) // the holder let go
	if _, err := d.node.NodeUnstageVolume(ctx, unstage); err != nil {
		t.Fatalf("NodeUnstage once the device is free: %v", err)
	}
	if b := e.connected(dev); b != "" {
		t.Fatalf("NodeUnstage succeeded and left %s connected for %q", dev, b)
	}
}

// A stage killed after its mount and before its record leaves the volume
// mounted at the staging path with no staged record. A NodeUnstage must
// still unmount it, and release the device: it skipped the unmount
// without a record, and the device, held by the mount, could not be
// released (every try failed, in use).
func TestUnstageWithoutARecordUnmountsTheStagingPath(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "unrecorded")
	m := mount.NewFakeMounter(nil)
	ops := e.kern.Ops()
	open := ops.OpenExclusive
	ops.OpenExclusive = func(i int) (attach.SyncCloser, error) {
		mps, _ := m.List()
		for _, mp := range mps {
			if mp.Device == kernel.Path(i) {
				return nil, fmt.Errorf("%s: %w", kernel.Path(i), kernel.ErrBusy)
			}
		}
		return open(i)
	}
	d := e.driver(t, ops, nil)
	defer d.Close()
	d.node.host = &Host{Mounter: m, FormatAndMount: m.Mount, ResizeFS: func(string, string) error { return nil },
		DeviceSize: func(string) (int64, error) { return 0, nil }}
	staging := filepath.Join(e.dir, "staging")
	stageMount(t, ctx, d, id, staging)
	dev, _, _ := d.node.attacher.Served(id)
	if err := d.node.remove(id); err != nil { // as if killed before the record was written
		t.Fatal(err)
	}
	if _, err := d.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstage of a volume mounted without a staged record: %v", err)
	}
	if mounted, _ := m.IsMountPoint(staging); mounted {
		t.Fatal("NodeUnstage left the staging path mounted")
	}
	if b := e.connected(dev); b != "" {
		t.Fatalf("NodeUnstage left %s connected for %q", dev, b)
	}
}

// statusHooked runs hook before every Status; an error it returns is
// Status's.
type statusHooked struct {
	attach.KernelConn
	hook func(context.Context) error
}

func (c statusHooked) Status(ctx context.Context, i int) (kernel.Device, error) {
	if err := c.hook(ctx); err != nil {
		return kernel.Device{}, err
	}
	return c.KernelConn.Status(ctx, i)
}

// hookStatus is the node's kernel with hook run before every Status.
func (e *nodeEnv) hookStatus(hook func(context.Context) error) *attach.Kernel {
	ops := e.kern.Ops()
	dial := ops.Dial
	ops.Dial = func() (attach.KernelConn, error) {
		c, err := dial()
		return statusHooked{c, hook}, err
	}
	return ops
}

// A plugin stopped (SIGTERM) while it recovers its staged volumes must
// leave the devices it did not get to as they were. The attach took a
// failed look at the kernel (the cancelled context) for "no longer
// connected" and removed the device's record; the next start attached a
// new device, while the old one, mounted, stayed connected with no
// server.
func TestACancelledRecoveryKeepsTheDevicesRecord(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id, dev, _ := e.stagedByADeadPlugin(t, ctx, "cancelled", false)

	// The real netlink client fails every call on a done context (the
	// fake kernel ignores contexts).
	d2 := e.driver(t, e.hookStatus(func(ctx context.Context) error { return ctx.Err() }), nil)
	stopped, stop := context.WithCancel(ctx)
	stop() // SIGTERM during the recovery
	if err := d2.node.recover(stopped); err == nil {
		t.Fatal("a recovery with its context ended succeeded")
	}
	d2.Close()
	if rec, err := attach.LoadRecord(e.attachDir(), id); err != nil || rec == nil {
		t.Fatalf("the cancelled recovery removed the attach record of %s (%v)", dev, err)
	}

	d3 := e.driver(t, nil, nil)
	defer d3.Close()
	if err := d3.node.recover(ctx); err != nil {
		t.Fatal(err)
	}
	if now, _, _ := d3.node.attacher.Served(id); now != dev {
		t.Fatalf("the next start serves the volume on %s, not on %s, which is still connected for %q", now, dev, e.connected(dev))
	}
}

// A repeated NodeStage (the kubelet's, after its own restart) of a volume
// staged and published to a running pod that fails must leave it served.
// It used to detach it, under the pod, although this call had attached
// nothing; the freed device then went to the next volume staged, and a
// block publish from the staged record gave the pod that other volume.
func TestAFailedRepeatedStageLeavesTheVolumeServed(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "restaged")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	dev := stage(t, ctx, d, id, staging)
	publish := func(target string) error {
		_, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: target, VolumeCapability: rwoCap()})
		return err
	}
	if err := publish(filepath.Join(e.dir, "pod", "mnt")); err != nil {
		t.Fatal(err)
	}
	// The staged record cannot be written (a full or read-only root
	// disk): the node's record dir does not exist.
	recordDir := d.node.dir
	d.node.dir = filepath.Join(e.dir, "no-such-dir")
	if _, err := d.node.NodeStageVolume(ctx, stageRequest(id, staging)); err == nil {
		t.Fatal("a stage whose record cannot be written succeeded")
	}
	d.node.dir = recordDir
	if now, _, ok := d.node.attacher.Served(id); !ok || now != dev || e.connected(dev) != attach.BackendID(id) {
		t.Fatalf("a failed repeated stage stopped serving the published volume (served %v on %q; %s connected for %q)", ok, now, dev, e.connected(dev))
	}
	other := e.volume(t, ctx, "restaged-other")
	if odev := stage(t, ctx, d, other, filepath.Join(e.dir, "staging-other")); odev == dev {
		t.Fatalf("another volume was staged on %s, still the first volume's", dev)
	}
	if err := publish(filepath.Join(e.dir, "pod2", "mnt")); err != nil {
		t.Fatal(err)
	}
}

// The node service answers calls while it recovers: a NodeUnstage the
// kubelet retries right after the restart must not be undone by the
// recovery. The recovery took no lock: the unstage found the volume not
// yet served and succeeded, then the recovery served it, staged nowhere.
func TestAnUnstageDuringRecoveryIsNotUndone(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id, _, staging := e.stagedByADeadPlugin(t, ctx, "unstaged-early", false)

	gate := make(chan struct{}) // every Status waits for it
	d2 := e.driver(t, e.hookStatus(func(context.Context) error { <-gate; return nil }), nil)
	defer d2.Close()
	recovered := make(chan error, 1)
	go func() { recovered <- d2.node.recover(ctx) }()
	time.Sleep(200 * time.Millisecond) // the recovery waits at its look at the kernel
	unstaged := make(chan error, 1)
	go func() {
		_, err := d2.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		unstaged <- err
	}()
	time.Sleep(200 * time.Millisecond)
	close(gate)
	rerr, uerr := <-recovered, <-unstaged
	t.Logf("recovery: %v; unstage: %v", rerr, uerr)
	rec, _ := d2.node.load(id)
	_, _, served := d2.node.attacher.Served(id)
	if uerr == nil && (served || rec != nil) {
		t.Fatalf("NodeUnstage succeeded, yet the volume is served afterwards: %v (staged record kept: %v)", served, rec != nil)
	}
	if uerr != nil && (!served || rec == nil) {
		t.Fatalf("NodeUnstage failed (%v), and the volume is not staged and served: served %v, record %v", uerr, served, rec != nil)
	}
}

// A staged volume that does not recover at the start (its cluster
// refused, a replica out of reach) is retried until it is served: the
// kubelet takes it for staged and does not stage it again, so a recovery
// tried once left the pod's I/O waiting on a device with no server.
func TestAStagedVolumeThatDoesNotRecoverIsRetried(t *testing.T) {
	oldWait, oldMax := recoverRetryWait, recoverRetryMaxWait
	recoverRetryWait, recoverRetryMaxWait = 50*time.Millisecond, 200*time.Millisecond
	defer func() { recoverRetryWait, recoverRetryMaxWait = oldWait, oldMax }()
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id, dev, _ := e.stagedByADeadPlugin(t, ctx, "retried", false)

	volumes := &failingVolumes{VolumeServiceClient: e.cl.Volumes}
	volumes.attachRefusals.Store(3)
	d2 := e.driver(t, nil, volumes)
	defer d2.Close()
	if err := d2.node.recover(ctx); err == nil {
		t.Fatal("the first recovery succeeded; the test expects its attach refused")
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if now, _, ok := d2.node.attacher.Served(id); ok {
			if now != dev {
				t.Fatalf("recovered on %s, not on its device %s", now, dev)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the volume is not served 30 s after its recovery failed (%d refusals left)", volumes.attachRefusals.Load())
		}
	}
}

// failingVolumes fails the first getFailures GetVolume calls with
// Unavailable (a cluster out of reach when the plugin restarts), refuses
// the first attachRefusals AttachVolume calls (FailedPrecondition), and
// answers the first attachRepliesLost AttachVolume calls that succeed
// with Unavailable (the reply lost after the commit).
type failingVolumes struct {
	storpb.VolumeServiceClient
	getFailures       atomic.Int32
	attachRefusals    atomic.Int32
	attachRepliesLost atomic.Int32
}

func (v *failingVolumes) AttachVolume(ctx context.Context, in *storpb.AttachVolumeRequest, opts ...grpc.CallOption) (*storpb.AttachVolumeResponse, error) {
	if v.attachRefusals.Add(-1) >= 0 {
		return nil, status.Error(codes.FailedPrecondition, "test: refused")
	}
	r, err := v.VolumeServiceClient.AttachVolume(ctx, in, opts...)
	if err == nil && v.attachRepliesLost.Add(-1) >= 0 {
		return nil, status.Error(codes.Unavailable, "test: the reply was lost")
	}
	return r, err
}

func (v *failingVolumes) GetVolume(ctx context.Context, in *storpb.GetVolumeRequest, opts ...grpc.CallOption) (*storpb.GetVolumeResponse, error) {
	if v.getFailures.Add(-1) >= 0 {
		return nil, status.Error(codes.Unavailable, "test: no leader")
	}
	return v.VolumeServiceClient.GetVolume(ctx, in, opts...)
}

// failingCluster fails the first listFailures ListServers calls.
type failingCluster struct {
	storpb.ClusterServiceClient
	listFailures atomic.Int32
}

func (c *failingCluster) ListServers(ctx context.Context, in *storpb.ListServersRequest, opts ...grpc.CallOption) (*storpb.ListServersResponse, error) {
	if c.listFailures.Add(-1) >= 0 {
		return nil, status.Error(codes.Unavailable, "test: no leader")
	}
	return c.ClusterServiceClient.ListServers(ctx, in, opts...)
}

// A plugin restart whose first look at the cluster fails, or whose resume
// fails after its own attach raised the volume's epoch, must resume the
// device at its next try, as long as nobody else attached the volume:
// the check that a recorded device's epoch is still the volume's took the
// first for a volume attached elsewhere, and the second for one attached
// again since (its own failed attach), and disconnected the mounted device
// both times.
func TestAFailedResumeIsResumedByTheNextTry(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *nodeEnv, cluster *Cluster)
	}{
		{"the volume could not be read", func(e *nodeEnv, cluster *Cluster) {
			v := &failingVolumes{VolumeServiceClient: e.cl.Volumes}
			v.getFailures.Store(1)
			cluster.Volumes = v
		}},
		{"the engine failed after its attach", func(e *nodeEnv, cluster *Cluster) {
			c := &failingCluster{ClusterServiceClient: e.cl.Cluster}
			c.listFailures.Store(1)
			cluster.Cluster = c
		}},
		{"the attach's reply was lost", func(e *nodeEnv, cluster *Cluster) {
			v := &failingVolumes{VolumeServiceClient: e.cl.Volumes}
			v.attachRepliesLost.Store(1)
			cluster.Volumes = v
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newNodeEnv(t)
			ctx := testCtx(t)
			id, dev, _ := e.stagedByADeadPlugin(t, ctx, "resumed", false)

			cluster := Cluster{Cluster: e.cl.Cluster, Volumes: e.cl.Volumes, Snapshots: e.cl.Snapshots}
			tc.setup(e, &cluster)
			d2 := e.driverOn(t, nil, cluster)
			defer d2.Close()
			if err := d2.node.recover(ctx); err == nil {
				t.Fatal("the first recovery succeeded; the test expects it to fail")
			}
			if b := e.connected(dev); b != attach.BackendID(id) {
				t.Fatalf("the failed recovery left %s connected for %q", dev, b)
			}
			if err := d2.node.recoverVolume(ctx, id); err != nil { // the retries' next look
				t.Fatal(err)
			}
			s := d2.node.attacher.(*kernelAttacher).served[id]
			if s == nil || !s.at.Resumed() || s.at.Device() != dev {
				t.Fatalf("the next try did not resume %s (connected for %q): same node, nobody else attached", dev, e.connected(dev))
			}
		})
	}
}

// A mount volume whose engine was fenced here keeps its staging mount on
// the device the fenced stop disconnected; staged again without an
// unstage between, the volume is served from a new device (on a real
// kernel another index: the mount holds the old one), and the staging
// path must be mounted from it: NodeStage saw the path mounted and
// returned, leaving pods on a filesystem whose every I/O fails.
func TestARestageMountsFromTheDeviceThatServesTheVolume(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "remount")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	req := stageMount(t, ctx, d, id, staging)
	e.forceDetach(t, ctx, d, id)
	m := staleMount(t, d, staging)
	e.controllerPublish(t, ctx, id)
	if _, err := d.node.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	mountedFromServed(t, d, m, id, staging)
}

// A mount volume whose engine was fenced here (a force detach) and which
// was then published to this node again, without an unstage between: the
// kubelet still takes it for staged and calls only NodePublish for the
// next pod. The publish bind-mounted the staging path, still mounted from
// the disconnected device, and the pod got I/O errors for good. Now it
// serves the volume and mounts it again from the serving device.
func TestAPublishAfterAFenceMountsFromTheDeviceThatServesTheVolume(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "republish")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	stageMount(t, ctx, d, id, staging)
	e.forceDetach(t, ctx, d, id)
	m := staleMount(t, d, staging)
	e.controllerPublish(t, ctx, id)
	target := filepath.Join(e.dir, "pod", "mount")
	if _, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: mountCap()}); err != nil {
		t.Fatalf("publish after the volume came back to this node: %v", err)
	}
	dev := mountedFromServed(t, d, m, id, staging)
	rec, err := d.node.load(id)
	if err != nil || rec == nil || rec.Device != dev {
		t.Fatalf("the staged record after the publish: %+v, %v; want device %s", rec, err, dev)
	}
}

// heldWatch holds every volume watch event, once held is set, until
// release is closed: an engine that has not yet seen that the volume left
// it.
type heldWatch struct {
	storpb.VolumeServiceClient
	held    *atomic.Bool
	release chan struct{}
}

func (w heldWatch) WatchVolume(ctx context.Context, in *storpb.WatchVolumeRequest, opts ...grpc.CallOption) (storpb.VolumeService_WatchVolumeClient, error) {
	st, err := w.VolumeServiceClient.WatchVolume(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	return heldStream{st, w}, nil
}

type heldStream struct {
	storpb.VolumeService_WatchVolumeClient
	w heldWatch
}

func (s heldStream) Recv() (*storpb.VolumeEvent, error) {
	ev, err := s.VolumeService_WatchVolumeClient.Recv()
	if s.w.held.Load() {
		select {
		case <-s.w.release:
		case <-s.Context().Done():
		}
	}
	return ev, err
}

// The same, but the publish comes before the fenced engine has seen the
// fence (a node cut off from the control plane reconnects: its engine's
// watch and the kubelet catch up together). The engine still served its
// device, so the publish took the staging mount for current and gave
// the pod a filesystem whose device the engine disconnected a moment
// later. The publish now waits for an engine below the volume's epoch to
// stop.
func TestAPublishBeforeTheEngineSeesItsFenceWaitsForIt(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "republish-early")
	w := heldWatch{VolumeServiceClient: e.cl.Volumes, held: new(atomic.Bool), release: make(chan struct{})}
	d := e.driver(t, nil, w)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	stageMount(t, ctx, d, id, staging)
	w.held.Store(true)
	if _, err := e.cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: e.node}); err != nil {
		t.Fatal(err)
	}
	e.controllerPublish(t, ctx, id)
	m := staleMount(t, d, staging)
	time.AfterFunc(time.Second, func() { close(w.release) })
	if _, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: filepath.Join(e.dir, "pod", "mount"), VolumeCapability: mountCap()}); err != nil {
		t.Fatalf("publish after the volume came back to this node: %v", err)
	}
	v, err := e.cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if err != nil {
		t.Fatal(err)
	}
	epoch, ok := d.node.attacher.Epoch(id)
	if !ok || epoch != v.GetVolume().GetEpoch() {
		t.Fatalf("published while the volume was served at epoch %d (served %v); the volume is at epoch %d", epoch, ok, v.GetVolume().GetEpoch())
	}
	mountedFromServed(t, d, m, id, staging)
}

// A mount volume served here from the device its staging path is mounted
// from is published while the cluster cannot be reached (an outage, an
// election): the pods on the node go on starting, as before the publish
// asked the cluster whether the engine is current. The first version of
// that check failed every such publish.
func TestAPublishOfAServedVolumeNeedsNoCluster(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "offline")
	v := &failingVolumes{VolumeServiceClient: e.cl.Volumes}
	d := e.driverOn(t, nil, Cluster{Cluster: e.cl.Cluster, Volumes: v, Snapshots: e.cl.Snapshots})
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	stageMount(t, ctx, d, id, staging)
	v.getFailures.Store(1 << 20)
	if _, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: filepath.Join(e.dir, "pod", "mount"), VolumeCapability: mountCap()}); err != nil {
		t.Fatalf("publish of a served volume without the cluster: %v", err)
	}
}

// A NodeUnstage of a mount volume staged here but not served (the plugin
// restarted) serves it first so that its unmount's writeback has a
// server; if that fails for a reason that may pass (the cluster out of
// reach), the unstage must fail, for the kubelet to retry: it unmounted
// anyway, and what the filesystem still had to write was lost while the
// kubelet went on to detach the volume.
func TestAnUnstageThatCannotServeItsVolumeForNowFails(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id, dev, staging := e.stagedByADeadPlugin(t, ctx, "unstage-later", true)

	v := &failingVolumes{VolumeServiceClient: e.cl.Volumes}
	v.getFailures.Store(1)
	d2 := e.driverOn(t, nil, Cluster{Cluster: e.cl.Cluster, Volumes: v, Snapshots: e.cl.Snapshots})
	defer d2.Close()
	m := mount.NewFakeMounter([]mount.MountPoint{{Device: dev, Path: staging}})
	d2.node.host.Mounter = m
	unstage := &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}
	if _, err := d2.node.NodeUnstageVolume(ctx, unstage); err == nil {
		t.Fatal("NodeUnstage succeeded although its volume could not be served for the unmount")
	}
	if mounted, _ := m.IsMountPoint(staging); !mounted {
		t.Fatal("the failed NodeUnstage unmounted the staging path with nothing serving its device")
	}
	if _, err := d2.node.NodeUnstageVolume(ctx, unstage); err != nil {
		t.Fatalf("the retried NodeUnstage: %v", err)
	}
	if b := e.connected(dev); b != "" {
		t.Fatalf("the retried NodeUnstage left %s connected for %q", dev, b)
	}
}

// A repeated NodeStage of a mount volume already staged and published
// keeps what it did not make: the record of the volume's publications
// (it wrote a record without them, losing the single-writer rule's and
// the read-only targets' memory) and, when its record cannot be written,
// the staging mount (it unmounted it under the running pods).
func TestARepeatedStageKeepsWhatItDidNotMake(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "restage-mount")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	req := stageMount(t, ctx, d, id, staging)
	target := filepath.Join(e.dir, "pod", "mnt")
	if _, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: mountCap()}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.node.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	if rec, err := d.node.load(id); err != nil || rec == nil || !slices.Contains(rec.Targets, target) {
		t.Fatalf("after a repeated stage the record of the volume's publications is %+v (%v), want it to name %s", rec, err, target)
	}
	recordDir := d.node.dir
	d.node.dir = filepath.Join(e.dir, "no-such-dir") // the record cannot be written
	if _, err := d.node.NodeStageVolume(ctx, req); err == nil {
		t.Fatal("a stage whose record cannot be written succeeded")
	}
	d.node.dir = recordDir
	if mounted, _ := d.node.host.Mounter.IsMountPoint(staging); !mounted {
		t.Fatal("a failed repeated stage unmounted the staging path it had not mounted")
	}
}

// A recovery whose record of the volume's new device could not be written
// repairs it at its next look: it found the volume served and returned,
// leaving the record on the old device, which a block publish then
// refused for good ("stage it again", which the kubelet does not do).
func TestARecoveryRepairsTheRecordOfTheDevice(t *testing.T) {
	e := newNodeEnv(t)
	ctx := testCtx(t)
	id := e.volume(t, ctx, "repair")
	d := e.driver(t, nil, nil)
	defer d.Close()
	staging := filepath.Join(e.dir, "staging")
	dev := stage(t, ctx, d, id, staging)
	rec, err := d.node.load(id)
	if err != nil {
		t.Fatal(err)
	}
	rec.Device = "/dev/nbd9" // what a recovery that served it anew failed to update
	if err := d.node.save(rec); err != nil {
		t.Fatal(err)
	}
	if err := d.node.recoverVolume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if rec, _ := d.node.load(id); rec == nil || rec.Device != dev {
		t.Fatalf("the record names %v, the volume is served on %s", rec, dev)
	}
	if _, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: filepath.Join(e.dir, "pod", "dev"), VolumeCapability: rwoCap()}); err != nil {
		t.Fatal(err)
	}
}
