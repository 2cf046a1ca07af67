package csi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	mount "k8s.io/mount-utils"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/internal/durable"
	"github.com/stor-io/stor/nbd/kernel"
)

// expandWait bounds how long NodeExpandVolume waits for the kernel device
// to reach the volume's new size (the engine learns of an expansion
// through its watch stream; the device follows within a second, or once
// the requests of a connection replaced just before were resent: 2.5 s
// with the plugin's one connection and no request timeout, but 32 s just
// after resuming a device an older stor-ctl left with the kernel's 30 s
// timer, when a first NodeExpandVolume fails and the orchestrator
// retries).
const expandWait = 30 * time.Second

// stagedRecord is what the node keeps about a staged volume, in
// <state-dir>/staged/<volume id>.json.
type stagedRecord struct {
	VolumeID    string `json:"volume_id"`
	StagingPath string `json:"staging_path"`
	Device      string `json:"device"`
	Block       bool   `json:"block"`
	FSType      string `json:"fs_type,omitempty"`
	ReadOnly    bool   `json:"read_only"`
	// Targets are the paths the volume is published at; ReadOnlyTargets
	// those of them published read-only. A second publish at a target
	// must ask for the same access (ALREADY_EXISTS otherwise).
	Targets         []string `json:"targets,omitempty"`
	ReadOnlyTargets []string `json:"read_only_targets,omitempty"`
}

type nodeServer struct {
	d          *Driver
	attacher   Attacher
	host       *Host
	dir        string // staged records
	registered atomic.Bool
	recovered  atomic.Bool
	// closing is closed by close; wg counts recovery retries.
	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup

	csipb.UnimplementedNodeServer
}

func newNodeServer(d *Driver) (*nodeServer, error) {
	n := &nodeServer{d: d, attacher: d.cfg.Attacher, host: d.cfg.Host, dir: filepath.Join(d.cfg.StateDir, "staged"), closing: make(chan struct{})}
	if n.attacher == nil {
		k := d.cfg.Kernel
		if k == nil {
			k = attach.RealKernel()
		}
		if err := checkKernel(k); err != nil {
			return nil, err
		}
		d.log.Info("the kernel's nbd netlink family is reachable")
		n.attacher = NewKernelAttacher(KernelAttacherConfig{
			StateDir: filepath.Join(d.cfg.StateDir, "nbd"), NodeID: d.cfg.NodeID,
			Cluster: d.cfg.Cluster, Kernel: k, Logger: d.log, DataDial: d.cfg.DataDial, LocalSockets: d.cfg.LocalSockets, LocalSocketDir: d.cfg.LocalSocketDir,
			RebuildInFlight: d.cfg.RebuildInFlight,
			Metrics:         d.volumes,
		})
	}
	if n.host == nil {
		n.host = NewHost()
	}
	if err := os.MkdirAll(n.dir, 0o700); err != nil {
		return nil, fmt.Errorf("csi: state dir: %w", err)
	}
	return n, nil
}

// checkKernel is the node plugin's start-up check: it opens and closes a
// connection to the kernel's nbd netlink family, so that a node whose
// kernel the plugin cannot use stops it at start, with the reason in the
// container's log, rather than letting it register, report ready and fail
// every NodeStageVolume. Before Linux 6.3 the family answers only in the
// host's network namespace (kernel.ErrNetNamespace): the pod must run with
// hostNetwork (deploy/kubernetes/base/csi-node.yaml does).
func checkKernel(k *attach.Kernel) error {
	c, err := k.Dial()
	switch {
	case errors.Is(err, kernel.ErrNetNamespace):
		return fmt.Errorf("csi: the node plugin cannot attach devices: %w (run the node plugin with hostNetwork: true)", err)
	case err != nil:
		return fmt.Errorf("csi: the node plugin cannot attach devices: %w", err)
	}
	return c.Close()
}

func (n *nodeServer) recordPath(id string) string { return filepath.Join(n.dir, id+".json") }

func (n *nodeServer) load(id string) (*stagedRecord, error) {
	if err := attach.ValidID(id); err != nil {
		return nil, invalidf("%v", err)
	}
	return durable.ReadJSON[stagedRecord](n.recordPath(id))
}

// save writes a record atomically and durably.
func (n *nodeServer) save(r *stagedRecord) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return durable.WriteFile(n.recordPath(r.VolumeID), b)
}

func (n *nodeServer) remove(id string) error {
	return durable.Remove(n.recordPath(id))
}

// Registration backoff: the first retry waits registerBackoffMin, each
// next one twice as long, up to registerBackoffMax.
const (
	registerBackoffMin = 100 * time.Millisecond
	registerBackoffMax = 5 * time.Second
)

// register records this node in the cluster (ClusterService.RegisterNode,
// an upsert by id: its zone and its volume limit) so that the controller
// accepts ControllerPublish to it, up to that limit.
// It retries with backoff while the cluster does not answer, until ctx
// ends; an id the cluster refuses (INVALID_ARGUMENT) is not retried.
func (n *nodeServer) register(ctx context.Context) error {
	wait := registerBackoffMin
	for attempt := 1; ; attempt++ {
		cctx, cancel := n.d.call(ctx)
		_, err := n.d.cfg.Cluster.Cluster.RegisterNode(cctx, &storpb.RegisterNodeRequest{
			Node: &storpb.Node{Id: n.d.cfg.NodeID, Zone: n.d.cfg.Zone, MaxVolumes: n.d.cfg.MaxVolumesPerNode},
		})
		cancel()
		switch {
		case err == nil:
			n.registered.Store(true)
			n.d.log.Info("registered the node with the cluster", "node", n.d.cfg.NodeID, "zone", n.d.cfg.Zone, "attempts", attempt)
			return nil
		case clusterCode(err) == codes.InvalidArgument:
			return fmt.Errorf("csi: the cluster refuses node id %q: %w", n.d.cfg.NodeID, err)
		}
		n.d.log.Warn("registering the node failed; retrying", "node", n.d.cfg.NodeID, "attempt", attempt, "retry_in", wait, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("csi: register node %q: %w (last error: %v)", n.d.cfg.NodeID, ctx.Err(), err)
		case <-t.C:
		}
		wait = min(2*wait, registerBackoffMax)
	}
}

// recover resumes every staged volume: the attacher reopens its engine at
// a new epoch and reconnects the recorded kernel device. Each volume is
// recovered under its operation lock, and only if it is still staged and
// not served: node calls are served from the start, so the kubelet's
// retry of a NodeUnstage (or a NodeStage) may get to a volume first, and a
// recovery that raced it served a volume the kubelet had just been told
// was unstaged. A volume whose lock a node call holds is left to that call
// and looked at again by the retries below: waiting for it could wait
// for ever (a NodeUnstage's unmount waits for the device's server, which
// is what this recovery would start), and would hold up every volume
// after it.
//
// A volume that does not recover (its cluster or a replica out of reach
// at the start) is retried in the background, at a wait that doubles from
// recoverRetryWait up to recoverRetryMaxWait, until it is served or
// unstaged, its volume is gone, ctx ends or the node service closes: the
// kubelet takes a staged volume for staged and would not stage it again,
// and its pods' I/O would wait on a device with no server for ever.
func (n *nodeServer) recover(ctx context.Context) error {
	defer n.recovered.Store(true)
	names, err := filepath.Glob(filepath.Join(n.dir, "*.json"))
	if err != nil {
		return err
	}
	var errs []error
	var retry []string
	for _, name := range names {
		id := strings.TrimSuffix(filepath.Base(name), ".json")
		err := n.recoverVolume(ctx, id)
		switch {
		case err == nil:
		case errors.Is(err, ErrBusy):
			retry = append(retry, id) // a node call has it: looked at again soon
		case clusterCode(err) == codes.NotFound:
			errs = append(errs, fmt.Errorf("volume %s: %w", id, err)) // deleted: nothing to retry
		default:
			errs = append(errs, fmt.Errorf("volume %s: %w", id, err))
			retry = append(retry, id)
		}
	}
	if len(retry) > 0 && ctx.Err() == nil {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.retryRecovery(ctx, retry)
		}()
	}
	return errors.Join(errs...)
}

// A staged volume that did not recover is retried after recoverRetryWait,
// the wait doubling up to recoverRetryMaxWait.
var (
	recoverRetryWait    = time.Second
	recoverRetryMaxWait = 30 * time.Second
)

// retryRecovery recovers the volumes ids again until each is served, no
// longer staged or gone, ctx ends or the node service closes.
func (n *nodeServer) retryRecovery(ctx context.Context, ids []string) {
	wait := recoverRetryWait
	for len(ids) > 0 {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-n.closing:
			t.Stop()
			return
		case <-t.C:
		}
		next := min(2*wait, recoverRetryMaxWait)
		var left []string
		for _, id := range ids {
			err := n.recoverVolume(ctx, id)
			switch {
			case err == nil:
			case errors.Is(err, ErrBusy):
				left = append(left, id)
			case clusterCode(err) == codes.NotFound:
				n.d.log.Warn("a staged volume's volume is gone; no longer retrying its recovery", "volume_id", id, "err", err)
			default:
				n.d.log.Warn("a staged volume is still not served; retrying", "volume_id", id, "retry_in", next, "err", err)
				left = append(left, id)
			}
		}
		ids, wait = left, next
	}
}

// recoverVolume serves staged volume id again, under its lock, unless it
// is no longer staged or is served already. If a node call holds the lock
// it returns at once, with ErrBusy.
func (n *nodeServer) recoverVolume(ctx context.Context, id string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case <-n.closing:
		return errors.New("the node service is closing")
	default:
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := n.load(id)
	if err != nil || r == nil {
		return err // unstaged meanwhile: nothing to recover
	}
	dev, _, served := n.attacher.Served(id)
	if !served { // else staged again meanwhile, or served by an earlier try
		if dev, err = n.attacher.Attach(ctx, id, r.ReadOnly); err != nil {
			return err
		}
	}
	if dev != r.Device {
		n.d.log.Warn("a staged volume came back on another device; what was mounted from the old one is lost", "volume_id", id, "was", r.Device, "now", dev)
		r.Device = dev
		if err := n.save(r); err != nil {
			return err
		}
	}
	n.d.log.Info("recovered a staged volume", "volume_id", id, "device", dev)
	return nil
}

func (n *nodeServer) close() {
	n.closeOnce.Do(func() { close(n.closing) })
	n.wg.Wait()
	n.attacher.Close()
}

var nodeCaps = []csipb.NodeServiceCapability_RPC_Type{
	csipb.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
	csipb.NodeServiceCapability_RPC_GET_VOLUME_STATS,
	csipb.NodeServiceCapability_RPC_EXPAND_VOLUME,
	csipb.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	csipb.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
}

func (n *nodeServer) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	var out []*csipb.NodeServiceCapability
	for _, t := range nodeCaps {
		out = append(out, &csipb.NodeServiceCapability{Type: &csipb.NodeServiceCapability_Rpc{
			Rpc: &csipb.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csipb.NodeGetCapabilitiesResponse{Capabilities: out}, nil
}

// NodeGetInfo reports the node id and its topology: the node key (how
// csi-provisioner names the selected node to CreateVolume, for locality;
// never returned in a volume's accessible topology) and the zone, if any.
func (n *nodeServer) NodeGetInfo(context.Context, *csipb.NodeGetInfoRequest) (*csipb.NodeGetInfoResponse, error) {
	seg := map[string]string{n.d.nodeKey(): n.d.cfg.NodeID}
	if n.d.cfg.Zone != "" {
		seg[n.d.zoneKey()] = n.d.cfg.Zone
	}
	return &csipb.NodeGetInfoResponse{
		NodeId: n.d.cfg.NodeID, MaxVolumesPerNode: n.d.cfg.MaxVolumesPerNode,
		AccessibleTopology: &csipb.Topology{Segments: seg},
	}, nil
}

func (n *nodeServer) getVolume(ctx context.Context, id string) (*storpb.Volume, error) {
	cctx, cancel := n.d.call(ctx)
	defer cancel()
	resp, err := n.d.cfg.Cluster.Volumes.GetVolume(cctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if clusterCode(err) == codes.NotFound || (err == nil && resp.GetVolume().GetState() == storpb.VolumeState_VOLUME_STATE_DELETED) {
		return nil, notFoundf("volume %q", id)
	}
	return resp.GetVolume(), err
}

func fsTypeOf(c *csipb.VolumeCapability, volCtx map[string]string) string {
	if fs := strings.ToLower(c.GetMount().GetFsType()); fs != "" {
		return fs
	}
	if fs := volCtx[ParamFSType]; fs != "" {
		return fs
	}
	return DefaultFSType
}

// NodeStageVolume attaches the volume here (engine, NBD server, kernel
// device) and, for a mount volume, formats it if blank and mounts it at
// the staging path.
func (n *nodeServer) NodeStageVolume(ctx context.Context, req *csipb.NodeStageVolumeRequest) (*csipb.NodeStageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalidf("NodeStageVolume: no volume id")
	case staging == "":
		return nil, invalidf("NodeStageVolume: no staging target path")
	case req.GetVolumeCapability() == nil:
		return nil, invalidf("NodeStageVolume: no volume capability")
	}
	if err := checkCap(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	_, block := req.GetVolumeCapability().GetAccessType().(*csipb.VolumeCapability_Block)
	fs := ""
	if !block {
		fs = fsTypeOf(req.GetVolumeCapability(), req.GetVolumeContext())
	}
	readOnly := req.GetPublishContext()[ctxReadOnly] == "true" ||
		req.GetVolumeCapability().GetAccessMode().GetMode() == csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY

	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	// Idempotent on the result, not on the record: a recorded volume whose
	// device is served (start-up recovery serves it again after a reboot)
	// may still have nothing mounted at the staging path; mounting it is
	// what this call is for. Publishing the bare staging directory would
	// send the pod's writes to the node's root disk.
	dev := ""
	if rec != nil {
		if rec.StagingPath != staging || rec.Block != block || rec.FSType != fs || rec.ReadOnly != readOnly {
			return nil, fmt.Errorf("%w: volume %q is staged at %s (block %v, fs %q, read-only %v)",
				ErrAlreadyExists, id, rec.StagingPath, rec.Block, rec.FSType, rec.ReadOnly)
		}
		// Recorded but not served (recovery failed): attach again below.
	}
	if d, _, ok := n.attacher.Served(id); ok {
		dev = d
	}
	attached, mountedHere := false, false // by this call
	if dev == "" {
		if _, err := n.getVolume(ctx, id); err != nil {
			return nil, err
		}
		if dev, err = n.attacher.Attach(ctx, id, readOnly); err != nil {
			return nil, err
		}
		attached = true
	}
	// A failure detaches only what this call attached: a repeated stage
	// (the kubelet's, after its own restart) of a volume already served
	// and perhaps published to a running pod must leave it served. It
	// disconnected the pod's device, whose index another volume's stage
	// could then take, and a block publish from the record's device
	// gave the pod that other volume.
	fail := func(err error) (*csipb.NodeStageVolumeResponse, error) {
		if !attached {
			return nil, err
		}
		if derr := n.attacher.Detach(context.WithoutCancel(ctx), id); derr != nil {
			n.d.log.Error("detaching after a failed stage", "volume_id", id, "err", derr)
		}
		return nil, err
	}
	if !block {
		if mountedHere, err = n.mountFrom(id, dev, staging, fs, req.GetVolumeCapability().GetMount().GetMountFlags(), readOnly); err != nil {
			return fail(err)
		}
	}
	staged := &stagedRecord{VolumeID: id, StagingPath: staging, Device: dev, Block: block, FSType: fs, ReadOnly: readOnly}
	if rec != nil {
		// A repeated stage: the volume's publications stay recorded (the
		// single-writer rule and the read-only targets read them).
		staged.Targets, staged.ReadOnlyTargets = rec.Targets, rec.ReadOnlyTargets
	}
	if err := n.save(staged); err != nil {
		if mountedHere {
			n.host.Mounter.Unmount(staging) // only what this call mounted
		}
		return fail(fmt.Errorf("record the staged volume: %w", err))
	}
	return &csipb.NodeStageVolumeResponse{}, nil
}

// fencedStopWait bounds how long restage waits for an engine that was
// fenced, and has not seen it yet, to stop; restageAskWait, how long it
// waits for the cluster's answer about the volume before it goes on
// without.
var (
	fencedStopWait = 5 * time.Second
	restageAskWait = 5 * time.Second
)

// restage makes the staging path of mount volume rec a mount of the
// device that serves the volume now, and records that device: it waits
// for an engine the volume has left (a lower epoch than the volume's) to
// stop, serves the volume if it is not served (a resume gives back the
// device the path is mounted from), unmounts a mount of another device
// and mounts the serving one where nothing is mounted.
func (n *nodeServer) restage(ctx context.Context, rec *stagedRecord, flags []string) error {
	id := rec.VolumeID
	// Without the cluster (an outage, an election) a volume served here
	// from the device its staging path is mounted from is published as
	// before this check: the pods on the node go on starting. What the
	// cluster is needed for is telling a fenced engine from a current one,
	// and serving the volume again.
	gctx, cancel := context.WithTimeout(ctx, restageAskWait)
	v, verr := n.getVolume(gctx, id)
	cancel()
	if errors.Is(verr, ErrNotFound) {
		return verr
	}
	for deadline := time.Now().Add(fencedStopWait); verr == nil; {
		e, ok := n.attacher.Epoch(id)
		if !ok || e >= v.GetEpoch() {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: the engine serving volume %q here is at epoch %d and the volume at %d: it was fenced and has not stopped yet; retry",
				ErrNotReady, id, e, v.GetEpoch())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	dev, _, ok := n.attacher.Served(id)
	if !ok {
		if verr != nil {
			return fmt.Errorf("volume %q is staged here but not served, and the cluster cannot be asked about it: %w", id, verr)
		}
		var err error
		if dev, err = n.attacher.Attach(ctx, id, rec.ReadOnly); err != nil {
			return fmt.Errorf("volume %q is staged here but not served, and serving it again failed: %w", id, err)
		}
	}
	if _, err := n.mountFrom(id, dev, rec.StagingPath, rec.FSType, flags, rec.ReadOnly); err != nil {
		return err
	}
	if rec.Device != dev {
		rec.Device = dev
		if err := n.save(rec); err != nil {
			return fmt.Errorf("record the staged volume's device: %w", err)
		}
	}
	return nil
}

// mountFrom makes the staging path of volume id a mount of dev, the
// device that serves the volume: a mount of another device is unmounted
// (unmountStale), and dev is mounted where nothing is (mountStaging). It
// reports whether it mounted.
func (n *nodeServer) mountFrom(id, dev, staging, fs string, flags []string, readOnly bool) (bool, error) {
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return false, fmt.Errorf("staging path: %w", err)
	}
	mounted, err := n.host.Mounter.IsMountPoint(staging)
	if err != nil {
		return false, fmt.Errorf("staging path: %w", err)
	}
	if mounted {
		if mounted, err = n.unmountStale(id, staging, dev); err != nil {
			return false, err
		}
	}
	if mounted {
		return false, nil
	}
	if err := n.mountStaging(dev, staging, fs, flags, readOnly); err != nil {
		return false, err
	}
	return true, nil
}

// unmountStale unmounts the staging path of volume id, which is mounted,
// when it is mounted from another device than dev, the one that serves
// the volume now (a device an engine fenced here disconnected, its
// filesystem still mounted): every I/O of that mount fails, and a pod
// published from it would get nothing else. It reports whether the path
// is still mounted (from dev).
func (n *nodeServer) unmountStale(id, staging, dev string) (bool, error) {
	from, _, err := mount.GetDeviceNameFromMount(n.host.Mounter, staging)
	if err != nil || from == "" || from == dev {
		return true, nil
	}
	n.d.log.Warn("the staging path is mounted from a device that no longer serves the volume; mounting it again",
		"volume_id", id, "mounted_from", from, "device", dev)
	if err := n.host.Mounter.Unmount(staging); err != nil {
		return true, fmt.Errorf("unmount %s, mounted from %s, which no longer serves the volume: %w", staging, from, err)
	}
	return false, nil
}

// mountStaging formats dev if it holds no filesystem, mounts it at the
// staging path and grows the filesystem to the device.
func (n *nodeServer) mountStaging(dev, staging, fs string, flags []string, readOnly bool) error {
	opts := append([]string{}, flags...)
	if readOnly {
		opts = append(opts, "ro")
	}
	if fs == "xfs" && !slices.Contains(opts, "nouuid") {
		// A clone or restored snapshot carries its source's XFS UUID;
		// without nouuid it cannot be mounted on the node where its
		// source is.
		opts = append(opts, "nouuid")
	}
	if err := n.host.FormatAndMount(dev, staging, fs, opts); err != nil {
		return fmt.Errorf("format and mount %s on %s: %w", dev, staging, err)
	}
	if !readOnly {
		// A volume restored or cloned into a larger claim holds its
		// source's smaller filesystem: grow it to the device (a no-op
		// for a filesystem that already fills it).
		if err := n.host.ResizeFS(dev, staging); err != nil {
			n.host.Mounter.Unmount(staging)
			return fmt.Errorf("grow the filesystem on %s to the volume's size: %w", dev, err)
		}
	}
	return nil
}

// NodeUnstageVolume unmounts the staging path, flushes and disconnects
// the device and closes the engine. The cluster attachment stays for
// ControllerUnpublish.
func (n *nodeServer) NodeUnstageVolume(ctx context.Context, req *csipb.NodeUnstageVolumeRequest) (*csipb.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalidf("NodeUnstageVolume: no volume id")
	case staging == "":
		return nil, invalidf("NodeUnstageVolume: no staging target path")
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec != nil && !rec.Block {
		// Staged here but not served (this process started and its
		// recovery has not got to it, or failed): serve it first, so
		// that what the unmount writes back has a server; the device
		// waits for one, and the recovery leaves a volume alone while
		// this call holds it. If it cannot be served, the unmount goes
		// on only if it never can be (attached elsewhere, or deleted): a
		// device of such a volume fails its I/O. Any other failure (the
		// cluster out of reach) fails the call, for the kubelet to retry,
		// rather than lose what the filesystem still has to write.
		if _, _, ok := n.attacher.Served(id); !ok {
			if _, err := n.attacher.Attach(ctx, id, rec.ReadOnly); err != nil {
				if code := clusterCode(err); code != codes.FailedPrecondition && code != codes.NotFound {
					return nil, fmt.Errorf("volume %q is staged here but not served, and serving it again for its unmount failed (retry): %w", id, err)
				}
				n.d.log.Warn("unstaging a volume that is not served, and can no longer be served here: what its filesystem still had to write is lost", "volume_id", id, "err", err)
			}
		}
	}
	// Without a record too: a stage killed between its mount and its
	// record left the volume mounted here, and the device, held by the
	// mount, could then never be released (attach.Release: in use).
	if rec == nil || !rec.Block {
		if mounted, err := n.host.Mounter.IsMountPoint(staging); err == nil && mounted {
			if err := n.host.Mounter.Unmount(staging); err != nil {
				return nil, fmt.Errorf("unmount %s: %w", staging, err)
			}
		} else if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("staging path: %w", err)
		}
	}
	if err := n.attacher.Detach(ctx, id); err != nil {
		return nil, err
	}
	if err := n.remove(id); err != nil {
		return nil, err
	}
	return &csipb.NodeUnstageVolumeResponse{}, nil
}

// NodePublishVolume bind-mounts the staging path (mount) or the device
// (block) at the target path, read-only if asked.
func (n *nodeServer) NodePublishVolume(ctx context.Context, req *csipb.NodePublishVolumeRequest) (*csipb.NodePublishVolumeResponse, error) {
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalidf("NodePublishVolume: no volume id")
	case target == "":
		return nil, invalidf("NodePublishVolume: no target path")
	case staging == "":
		return nil, invalidf("NodePublishVolume: no staging target path")
	case req.GetVolumeCapability() == nil:
		return nil, invalidf("NodePublishVolume: no volume capability")
	}
	if err := checkCap(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		if _, err := n.getVolume(ctx, id); err != nil {
			return nil, err
		}
		return nil, preconditionf("volume %q is not staged on this node", id)
	}
	if req.GetVolumeCapability().GetAccessMode().GetMode() == csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		for _, t := range rec.Targets {
			if t != target {
				return nil, preconditionf("volume %q has single-writer access and is published at %s", id, t)
			}
		}
	}
	_, block := req.GetVolumeCapability().GetAccessType().(*csipb.VolumeCapability_Block)
	readOnly := req.GetReadonly() || rec.ReadOnly
	if slices.Contains(rec.Targets, target) && (block != rec.Block || readOnly != slices.Contains(rec.ReadOnlyTargets, target)) {
		return nil, fmt.Errorf("%w: volume %q is published at %s with block access %v, read-only %v; asked for block %v, read-only %v",
			ErrAlreadyExists, id, target, rec.Block, slices.Contains(rec.ReadOnlyTargets, target), block, readOnly)
	}
	if block != rec.Block {
		return nil, invalidf("volume %q is staged with block access %v, published with %v", id, rec.Block, block)
	}
	if !block {
		// The staging path must be a mount of the device that serves the
		// volume now. Bind-mounting it with nothing mounted gave the pod
		// the node's root disk (after a reboot); with the filesystem of a
		// device an engine fenced here disconnected (a force detach, and
		// the volume published here again: the kubelet, which still takes
		// it for staged, does not stage it again), I/O errors for good.
		if err := n.restage(ctx, rec, req.GetVolumeCapability().GetMount().GetMountFlags()); err != nil {
			return nil, err
		}
	}
	opts := []string{"bind"}
	if readOnly {
		opts = append(opts, "ro")
	}
	source := rec.StagingPath
	if block {
		// The same for a device: the recorded one must be this volume's,
		// served now; a device that was disconnected may have been taken
		// by another volume since.
		if dev, _, ok := n.attacher.Served(id); !ok || dev != rec.Device {
			return nil, preconditionf("volume %q is not served on %s, its staged device; stage it again", id, rec.Device)
		}
		source = rec.Device
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return nil, fmt.Errorf("target path: %w", err)
		}
		f, err := os.OpenFile(target, os.O_CREATE, 0o640)
		if err != nil {
			return nil, fmt.Errorf("target path: %w", err)
		}
		f.Close()
	} else {
		if err := os.MkdirAll(target, 0o750); err != nil {
			return nil, fmt.Errorf("target path: %w", err)
		}
		opts = append(opts, req.GetVolumeCapability().GetMount().GetMountFlags()...)
	}
	mounted, err := n.host.Mounter.IsMountPoint(target)
	if err != nil {
		return nil, fmt.Errorf("target path: %w", err)
	}
	if !mounted {
		if err := n.host.Mounter.Mount(source, target, "", opts); err != nil {
			return nil, fmt.Errorf("bind mount %s on %s: %w", source, target, err)
		}
	}
	if !slices.Contains(rec.Targets, target) {
		rec.Targets = append(rec.Targets, target)
		if readOnly {
			rec.ReadOnlyTargets = append(rec.ReadOnlyTargets, target)
		}
		if err := n.save(rec); err != nil {
			return nil, fmt.Errorf("record the publication: %w", err)
		}
	}
	return &csipb.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts the target path and removes it.
func (n *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csipb.NodeUnpublishVolumeRequest) (*csipb.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	switch {
	case id == "":
		return nil, invalidf("NodeUnpublishVolume: no volume id")
	case target == "":
		return nil, invalidf("NodeUnpublishVolume: no target path")
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := mount.CleanupMountPoint(target, n.host.Mounter, true); err != nil {
		return nil, fmt.Errorf("unmount %s: %w", target, err)
	}
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec != nil && slices.Contains(rec.Targets, target) {
		rec.Targets = slices.DeleteFunc(rec.Targets, func(t string) bool { return t == target })
		rec.ReadOnlyTargets = slices.DeleteFunc(rec.ReadOnlyTargets, func(t string) bool { return t == target })
		if err := n.save(rec); err != nil {
			return nil, fmt.Errorf("record the unpublication: %w", err)
		}
	}
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports bytes and inodes of a mounted volume, or a
// block volume's size. (CSI 1.13 moved the volume condition to
// NodeGetVolumeHealth.)
func (n *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csipb.NodeGetVolumeStatsRequest) (*csipb.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, invalidf("NodeGetVolumeStats: no volume id")
	case path == "":
		return nil, invalidf("NodeGetVolumeStats: no volume path")
	}
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, notFoundf("volume %q is not staged on this node", id)
	}
	st, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, notFoundf("volume path %s", path)
	}
	if err != nil {
		return nil, err
	}
	resp := &csipb.NodeGetVolumeStatsResponse{}
	if rec.Block || !st.IsDir() {
		size, err := n.host.DeviceSize(rec.Device)
		if err != nil {
			return nil, err
		}
		resp.Usage = []*csipb.VolumeUsage{{Unit: csipb.VolumeUsage_BYTES, Total: size}}
	} else {
		var fs unix.Statfs_t
		if err := unix.Statfs(path, &fs); err != nil {
			return nil, fmt.Errorf("statfs %s: %w", path, err)
		}
		bs := int64(fs.Bsize)
		resp.Usage = []*csipb.VolumeUsage{
			{Unit: csipb.VolumeUsage_BYTES, Total: int64(fs.Blocks) * bs, Available: int64(fs.Bavail) * bs,
				Used: int64(fs.Blocks-fs.Bfree) * bs},
			{Unit: csipb.VolumeUsage_INODES, Total: int64(fs.Files), Available: int64(fs.Ffree),
				Used: int64(fs.Files - fs.Ffree)},
		}
	}
	return resp, nil
}

// NodeGetVolumeHealth: INACCESSIBLE when this node no longer serves a
// staged volume (its engine was fenced by a newer attach, or recovery
// failed), else the replica set's health from the cluster.
func (n *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csipb.NodeGetVolumeHealthRequest) (*csipb.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalidf("NodeGetVolumeHealth: no volume id")
	}
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, notFoundf("volume %q is not staged on this node", id)
	}
	if _, _, ok := n.attacher.Served(id); !ok {
		return &csipb.NodeGetVolumeHealthResponse{VolumeHealth: &csipb.VolumeHealth{VolumeId: id,
			HealthStatuses: []*csipb.VolumeHealth_VolumeHealthEntry{{
				Status: csipb.VolumeHealthErrorType_INACCESSIBLE, Reason: "NotServed",
				Message: "this node no longer serves the volume: its engine was fenced by a newer attach, or recovery failed",
			}}}}, nil
	}
	v, err := n.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	return &csipb.NodeGetVolumeHealthResponse{VolumeHealth: health(v)}, nil
}

// NodeExpandVolume waits for the kernel device to reach the volume's size
// (the engine learns of ControllerExpandVolume from the cluster and grows
// the device) and grows the filesystem (mount-utils ResizeFs).
func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csipb.NodeExpandVolumeRequest) (*csipb.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, invalidf("NodeExpandVolume: no volume id")
	case path == "":
		return nil, invalidf("NodeExpandVolume: no volume path")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCap(c); err != nil {
			return nil, err
		}
	}
	unlock, err := n.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := n.load(id)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, notFoundf("volume %q is not staged on this node", id)
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil, notFoundf("volume path %s", path)
	}
	v, err := n.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	want := v.GetSizeBytes()
	if req := req.GetCapacityRange().GetRequiredBytes(); req > 0 && uint64(req) > want {
		return nil, fmt.Errorf("%w: volume %q is %d bytes in the cluster, less than the %d asked: expand it with ControllerExpandVolume first",
			ErrOutOfRange, id, want, req)
	}
	deadline := time.Now().Add(expandWait)
	for {
		_, size, ok := n.attacher.Served(id)
		if !ok {
			return nil, preconditionf("volume %q is not served on this node", id)
		}
		if size >= want/BlockSize*BlockSize {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: the device of volume %q is %d bytes, not yet %d after %v",
				ErrNotReady, id, size, want, expandWait)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	if !rec.Block {
		if err := n.host.ResizeFS(rec.Device, rec.StagingPath); err != nil {
			return nil, fmt.Errorf("grow the filesystem on %s: %w", rec.Device, err)
		}
	}
	return &csipb.NodeExpandVolumeResponse{CapacityBytes: int64(want)}, nil
}
