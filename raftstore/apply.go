package raftstore

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

const (
	// BlockSize is the unit volume sizes are rounded up to.
	BlockSize = 4096
	// MaxReplicas bounds a volume's replica count.
	MaxReplicas = 7
	// MaxVolumeSize bounds a volume's size (1 PiB, the replica store's
	// limit); it also keeps every size far from integer overflow.
	MaxVolumeSize = 1 << 50
	// maxNameLen bounds volume and snapshot names (a Kubernetes PV name is
	// at most 253 bytes).
	maxNameLen = 253
	// MaxLabels bounds the entries of a volume's parameters and of a
	// server's or node's labels.
	MaxLabels = 64
	// MaxLabelKeyLen bounds a parameter or label key (a Kubernetes
	// qualified name is at most a 253-byte prefix, '/', and 63 bytes).
	MaxLabelKeyLen = 317
	// MaxLabelValueLen bounds a parameter or label value.
	MaxLabelValueLen = 4096
	// MaxLabelBytes bounds the keys and values of one map together.
	MaxLabelBytes = 16 << 10
	// MaxSnapshotsPerVolume bounds a volume's snapshots (each is a layer
	// on every replica, which reads may have to walk); one more is
	// ErrResourceExhausted.
	MaxSnapshotsPerVolume = 256
)

// CheckLabels checks a volume's parameters or a server's or node's labels
// (what names the map in the error): at most MaxLabels entries, keys of
// 1..MaxLabelKeyLen bytes with no whitespace or control characters, values
// of at most MaxLabelValueLen bytes, MaxLabelBytes in all; else
// ErrInvalidArgument. Keys are checked in sorted order, so the error is
// deterministic.
func CheckLabels(what string, m map[string]string) error {
	if len(m) > MaxLabels {
		return fmt.Errorf("%w: %s: %d entries, the limit is %d", ErrInvalidArgument, what, len(m), MaxLabels)
	}
	total := 0
	for _, k := range slices.Sorted(maps.Keys(m)) {
		v := m[k]
		switch {
		case k == "" || len(k) > MaxLabelKeyLen:
			return fmt.Errorf("%w: %s: key %s is %d bytes, want 1..%d", ErrInvalidArgument, what, QuoteID(k), len(k), MaxLabelKeyLen)
		case strings.IndexFunc(k, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) }) >= 0:
			return fmt.Errorf("%w: %s: key %s contains whitespace or a control character", ErrInvalidArgument, what, QuoteID(k))
		case len(v) > MaxLabelValueLen:
			return fmt.Errorf("%w: %s: the value of %s is %d bytes, the limit is %d", ErrInvalidArgument, what, QuoteID(k), len(v), MaxLabelValueLen)
		}
		total += len(k) + len(v)
	}
	if total > MaxLabelBytes {
		return fmt.Errorf("%w: %s: %d bytes of keys and values, the limit is %d", ErrInvalidArgument, what, total, MaxLabelBytes)
	}
	return nil
}

// RoundSize rounds a size up to a multiple of BlockSize. Sizes above
// MaxVolumeSize are returned unchanged (callers refuse them).
func RoundSize(size uint64) uint64 {
	if size > MaxVolumeSize {
		return size
	}
	return (size + BlockSize - 1) / BlockSize * BlockSize
}

// checkSize refuses zero and oversized volume sizes.
func checkSize(name string, size uint64) error {
	switch {
	case size == 0:
		return fmt.Errorf("%w: volume %q: size must be positive", ErrInvalidArgument, name)
	case size > MaxVolumeSize:
		return fmt.Errorf("%w: volume %q: size %d exceeds the limit of %d bytes (1 PiB)", ErrInvalidArgument, name, size, uint64(MaxVolumeSize))
	}
	return nil
}

// apply executes one command. Each case validates everything first and
// only then writes, so a refused command changes nothing.
func (w *writer) apply(c command) (proto.Message, error) {
	w.op, w.at, w.reason = c.Op, c.At, ""
	if r, ok := c.Body.(*storpb.SetReplicaStateRequest); ok {
		w.reason = r.Reason
	}
	switch c.Op {
	case opInitCluster:
		if cur := w.ClusterID(); cur != "" {
			return nil, nil // first one wins; later proposals are no-ops
		}
		w.putRaw(bucketMeta, string(keyClusterID), c.ID)
		return nil, nil
	case opRegisterServer:
		return w.registerServer(c.At, c.Body.(*storpb.Server))
	case opSetServerState:
		return w.setServerState(c.At, c.Body.(*storpb.Server))
	case opRemoveServer:
		return w.removeServer(c.At, c.ID)
	case opCreateVolume:
		return w.createVolume(c.At, c.ID, c.Body.(*storpb.CreateVolumeRequest))
	case opDeleteVolume:
		return w.deleteVolume(c.At, c.Body.(*storpb.VolumeRef))
	case opExpandVolume:
		return w.expandVolume(c.Body.(*storpb.ExpandVolumeRequest))
	case opAttachVolume:
		return w.attachVolume(c.At, c.Body.(*storpb.AttachVolumeRequest))
	case opDetachVolume:
		return w.detachVolume(c.Body.(*storpb.DetachVolumeRequest))
	case opCreateSnapshot:
		return w.createSnapshot(c.At, c.ID, c.Body.(*storpb.CreateSnapshotRequest))
	case opDeleteSnapshot:
		return w.deleteSnapshot(c.Body.(*storpb.SnapshotRef))
	case opSetReplicaState:
		return w.setReplicaState(c.At, c.Body.(*storpb.SetReplicaStateRequest))
	case opReplaceReplica:
		return w.replaceReplica(c.At, c.ID, c.Body.(*storpb.ReplaceReplicaRequest), false)
	case opRepairReplica:
		return w.replaceReplica(c.At, c.ID, c.Body.(*storpb.ReplaceReplicaRequest), true)
	case opRecordCut:
		return w.recordCut(c.Body.(*storpb.RecordSnapshotCutRequest))
	case opRecordCloneCopy:
		return w.recordCloneCopied(c.Body.(*storpb.RecordCloneCopiedRequest))
	case opRegisterNode:
		return w.registerNode(c.At, c.Body.(*storpb.Node))
	case opSetClusterConfig:
		return w.setClusterConfig(c.Body.(*storpb.ClusterConfig))
	case opCordonServer:
		return w.cordonServer(c.Body.(*storpb.Server))
	}
	return nil, fmt.Errorf("%w: no handler for %v", ErrCorrupt, c.Op)
}

// ValidateName checks a volume or snapshot name.
func ValidateName(kind, name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: %s name is empty", ErrInvalidArgument, kind)
	case len(name) > maxNameLen:
		return fmt.Errorf("%w: %s name is %d bytes, the limit is %d", ErrInvalidArgument, kind, len(name), maxNameLen)
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: %s name is not valid UTF-8", ErrInvalidArgument, kind)
	}
	for _, r := range name {
		if unicode.IsControl(r) || unicode.IsSpace(r) {
			return fmt.Errorf("%w: %s name %q contains whitespace or a control character", ErrInvalidArgument, kind, name)
		}
	}
	return nil
}

// ---------------------------------------------------------------- servers

func (w *writer) registerServer(at int64, in *storpb.Server) (proto.Message, error) {
	if in.Id == "" || in.Address == "" || in.RaftAddress == "" {
		return nil, fmt.Errorf("%w: a server needs an id, a control address and a raft address", ErrInvalidArgument)
	}
	if err := checkServerIDs(in); err != nil {
		return nil, err
	}
	if err := CheckLabels(fmt.Sprintf("server %s: labels", in.Id), in.Labels); err != nil {
		return nil, err
	}
	s, err := w.Server(in.Id)
	if err == nil {
		// The leader refuses such a server before it proposes anything
		// (dataDirMatches); this keeps a register that slipped past it (a
		// leader of an older version) from naming a dir the record's
		// replicas are not on. A record is only named anew when the server
		// is removed and joins again.
		if err := dataDirMatches(s, in); err != nil {
			return nil, err
		}
	}
	switch {
	case err == nil:
		s.Address, s.RaftAddress, s.DataAddress = in.Address, in.RaftAddress, in.DataAddress
		s.Zone, s.Labels, s.CapacityBytes, s.KubernetesNode = in.Zone, in.Labels, in.CapacityBytes, in.KubernetesNode
		if in.DataDirId != "" { // "": a server of an older version
			s.DataDirId = in.DataDirId
		}
		s.RaftClusterCheck = in.RaftClusterCheck // false: of an older version (again)
	default:
		s = &storpb.Server{
			Id: in.Id, Address: in.Address, RaftAddress: in.RaftAddress, DataAddress: in.DataAddress,
			Zone: in.Zone, Labels: in.Labels, CapacityBytes: in.CapacityBytes, KubernetesNode: in.KubernetesNode,
			State: storpb.ServerState_SERVER_STATE_UP, JoinedUnixNano: at, LastSeenUnixNano: at, DataDirId: in.DataDirId,
			RaftClusterCheck: in.RaftClusterCheck,
		}
	}
	w.put(bucketServers, s.Id, s)
	return s, nil
}

func (w *writer) setServerState(at int64, in *storpb.Server) (proto.Message, error) {
	switch in.State {
	case storpb.ServerState_SERVER_STATE_UP, storpb.ServerState_SERVER_STATE_DOWN, storpb.ServerState_SERVER_STATE_DRAINING:
	default:
		return nil, fmt.Errorf("%w: server state %v", ErrInvalidArgument, in.State)
	}
	s, err := w.Server(in.Id)
	if err != nil {
		return nil, err
	}
	s.State = in.State
	s.LastSeenUnixNano = max(s.LastSeenUnixNano, in.LastSeenUnixNano)
	w.put(bucketServers, s.Id, s)
	return s, nil
}

// cordonServer sets or clears a server's cordon (opCordonServer): a
// cordoned server receives no new replica (Place); its replicas stay,
// unless it is also draining (the leader moves them: drainReplicas). A
// drain implies the cordon; a cordon without drain keeps a drain going;
// clearing the cordon ends it.
func (w *writer) cordonServer(in *storpb.Server) (proto.Message, error) {
	s, err := w.Server(in.Id)
	if err != nil {
		return nil, err
	}
	// A cordon keeps a drain going; only an uncordon ends it.
	s.Cordoned = in.Cordoned || in.Draining
	s.Draining = s.Cordoned && (s.Draining || in.Draining)
	w.put(bucketServers, s.Id, s)
	return s, nil
}

// removeServer forgets a server. Its replicas are lost with it: each
// becomes faulty in a new replica-set generation and is flagged
// ServerRemoved, so it counts against no server (not even one registered
// again under the same id) until the leader replaces it, and its snapshot
// copies are recorded lost at once (loseReplica).
func (w *writer) removeServer(at int64, id string) (proto.Message, error) {
	s, err := w.Server(id)
	if err != nil {
		return nil, err
	}
	vols, _, err := w.Volumes("", 0)
	if err != nil {
		return nil, err
	}
	var changed []string
	for _, v := range vols {
		lost := false
		for _, r := range v.Replicas {
			if r.ServerId == id && !r.ServerRemoved {
				w.must(moveReplica(v, r, eventServerRemoved, at, 0))
				if err := w.loseReplica(v, r.Id, fmt.Sprintf("its server %s was removed from the cluster", id)); err != nil {
					return nil, err
				}
				lost = true
			}
		}
		if lost {
			w.putVolume(v)
			changed = append(changed, v.Id)
		}
	}
	// Then the clones it finishes, each read again: finishing one drops
	// its implicit snapshot, which may remove its source volume (deleted,
	// kept for the snapshot), a volume the loop above held a copy of.
	for _, vid := range changed {
		v, err := w.Volume(vid)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
			continue
		}
		if err := w.finishClone(v); err != nil {
			return nil, err
		}
		if v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
			w.putVolume(v)
		}
	}
	w.del(bucketServers, id)
	return s, nil
}

// addAllocated changes the bytes promised on each server by delta (which
// may be negative). Servers that no longer exist are skipped.
func (w *writer) addAllocated(serverIDs []string, delta int64) {
	for _, id := range serverIDs {
		s, err := w.Server(id)
		if err != nil {
			continue
		}
		if delta < 0 && uint64(-delta) > s.AllocatedBytes {
			s.AllocatedBytes = 0
		} else {
			s.AllocatedBytes = uint64(int64(s.AllocatedBytes) + delta)
		}
		w.put(bucketServers, id, s)
	}
}

// ---------------------------------------------------------------- volumes

// replicaServers lists the servers whose allocation a volume's replicas
// count against (not those of replicas whose server was removed).
func replicaServers(v *storpb.Volume) []string {
	ids := make([]string, 0, len(v.Replicas))
	for _, r := range v.Replicas {
		if !r.ServerRemoved {
			ids = append(ids, r.ServerId)
		}
	}
	return ids
}

func (w *writer) createVolume(at int64, id string, req *storpb.CreateVolumeRequest) (proto.Message, error) {
	if err := ValidateName("volume", req.Name); err != nil {
		return nil, err
	}
	if err := checkSize(req.Name, req.SizeBytes); err != nil {
		return nil, err
	}
	if err := CheckLabels(fmt.Sprintf("volume %q: parameters", req.Name), req.Parameters); err != nil {
		return nil, err
	}
	size := RoundSize(req.SizeBytes)
	switch {
	case req.ReplicaCount < 1 || req.ReplicaCount > MaxReplicas:
		return nil, fmt.Errorf("%w: volume %q: replica count %d is outside 1..%d", ErrInvalidArgument, req.Name, req.ReplicaCount, MaxReplicas)
	}
	if existing, err := w.VolumeByName(req.Name); err == nil {
		if existing.SizeBytes != size || existing.ReplicaCount != req.ReplicaCount ||
			!maps.Equal(existing.Parameters, req.Parameters) ||
			!proto.Equal(existing.ContentSource, req.ContentSource) {
			return nil, fmt.Errorf("%w: volume %q exists with size %d, %d replicas and other parameters or source",
				ErrAlreadyExists, req.Name, existing.SizeBytes, existing.ReplicaCount)
		}
		return existing, nil // idempotent
	}
	clone, err := w.prepareClone(at, id, req.ContentSource, size)
	if err != nil {
		return nil, fmt.Errorf("volume %q: %w", req.Name, err)
	}
	servers, err := w.Servers()
	if err != nil {
		return nil, err
	}
	percent, err := w.overProvisioningPercent()
	if err != nil {
		return nil, err
	}
	chosen, err := Place(servers, PlaceRequest{
		Replicas: int(req.ReplicaCount), SizeBytes: size, Accessibility: req.Accessibility,
		OverProvisioningPercent: percent,
	})
	if err != nil {
		return nil, fmt.Errorf("volume %q: %w", req.Name, err)
	}
	v := &storpb.Volume{
		Id: id, Name: req.Name, SizeBytes: size, ReplicaCount: req.ReplicaCount,
		Parameters: req.Parameters, ContentSource: req.ContentSource,
		State: storpb.VolumeState_VOLUME_STATE_AVAILABLE, Generation: 1,
		CreatedUnixNano: at, Accessibility: req.Accessibility,
	}
	for i, sid := range chosen {
		v.Replicas = append(v.Replicas, newReplica(v, fmt.Sprintf("%s-r%d", id, i+1), sid, storpb.ReplicaState_REPLICA_STATE_HEALTHY, at))
	}
	w.addAllocated(chosen, int64(size))
	w.startClone(v, clone)
	w.put(bucketVolumes, v.Id, v)
	w.putRaw(bucketVolumeNames, v.Name, v.Id)
	return v, nil
}

func (w *writer) expandVolume(req *storpb.ExpandVolumeRequest) (proto.Message, error) {
	v, err := w.VolumeByRef(req.Volume)
	if err != nil {
		return nil, err
	}
	if err := checkVolume(v, actExpand); err != nil {
		return nil, err
	}
	if err := checkSize(v.Name, req.SizeBytes); err != nil {
		return nil, err
	}
	size := RoundSize(req.SizeBytes)
	switch {
	case size < v.SizeBytes:
		return nil, fmt.Errorf("%w: volume %q is %d bytes; volumes cannot shrink to %d", ErrFailedPrecondition, v.Name, v.SizeBytes, size)
	case size == v.SizeBytes:
		return v, nil
	}
	// A snapshot records the volume's size when it is taken, and each
	// replica freezes its layer at its own size when it cuts: an expand
	// between the two would give the snapshot data past its recorded size
	// (a clone of that size could never be filled).
	if n := len(v.PendingSnapshotIds); n > 0 {
		return nil, fmt.Errorf("%w: volume %q has %d snapshot(s) not yet cut (%s); it can be expanded once they are cut, so that each snapshot holds the size it was taken at",
			ErrFailedPrecondition, v.Name, n, strings.Join(v.PendingSnapshotIds, ", "))
	}
	delta := size - v.SizeBytes
	percent, err := w.overProvisioningPercent()
	if err != nil {
		return nil, err
	}
	for _, sid := range replicaServers(v) {
		s, err := w.Server(sid)
		if err != nil {
			continue // a removed server's replica is faulty and grows nothing
		}
		if free := ProvisionableBytes(s, percent); free < delta {
			return nil, fmt.Errorf("%w: volume %q: server %q has %d bytes free (over-provisioning %d%%), growing needs %d",
				ErrInsufficientCapacity, v.Name, sid, free, percent, delta)
		}
	}
	w.addAllocated(replicaServers(v), int64(delta))
	v.SizeBytes = size
	w.put(bucketVolumes, v.Id, v)
	return v, nil
}

func (w *writer) attachVolume(at int64, req *storpb.AttachVolumeRequest) (proto.Message, error) {
	v, err := w.VolumeByRef(req.Volume)
	if err != nil {
		return nil, err
	}
	if err := CheckNodeID(fmt.Sprintf("attach volume %q: node id", v.Name), req.NodeId); err != nil {
		return nil, err
	}
	if err := checkVolume(v, actAttach); err != nil {
		if s, serr := w.Snapshot(v.CloneSnapshotId); serr == nil && cloneFailed(v, s) != "" {
			return nil, fmt.Errorf("%w: %s", ErrFailedPrecondition, cloneFailed(v, s))
		}
		return nil, err
	}
	switch {
	case v.Attachment != nil && v.Attachment.NodeId != req.NodeId && !req.Takeover:
		return nil, fmt.Errorf("%w: volume %q is attached to node %q", ErrFailedPrecondition, v.Name, v.Attachment.NodeId)
	case req.RequireAttached && (v.Attachment == nil || v.Attachment.NodeId != req.NodeId):
		return nil, fmt.Errorf("%w: volume %q is not attached to node %q (%s); only a publish attaches it",
			ErrFailedPrecondition, v.Name, req.NodeId, describeAttachment(v.Attachment))
	}
	mode := req.Mode
	if mode == storpb.AccessMode_ACCESS_MODE_UNSPECIFIED {
		mode = storpb.AccessMode_ACCESS_MODE_READ_WRITE
	}
	if req.RequireAttached {
		// A re-attach (a node's, at its plugin's restart or a restage)
		// keeps the publication's mode: only a publish sets it, and a
		// node may not make a volume published to it read-only writable.
		pub := v.Attachment.Mode
		if pub == storpb.AccessMode_ACCESS_MODE_READ_ONLY && mode != pub {
			return nil, fmt.Errorf("%w: volume %q is published to node %q read-only; a re-attach cannot make it writable",
				ErrFailedPrecondition, v.Name, req.NodeId)
		}
		if pub != storpb.AccessMode_ACCESS_MODE_UNSPECIFIED {
			mode = pub
		}
	}
	v.Epoch++
	v.Attachment = &storpb.Attachment{NodeId: req.NodeId, Mode: mode, AttachedUnixNano: at}
	w.put(bucketVolumes, v.Id, v)
	return v, nil
}

// detachVolume ends v's attachment and raises its epoch: the engine that
// held it, or a zombie of it on a lost node, is fenced by every replica
// its servers fence at the new epoch, and by its own watch. No engine holds
// the new epoch, so it is the point a detached snapshot is cut at (below).
//
// With fence_detached the volume must be detached already: the epoch is
// raised without attaching it. A server cutting a detached volume's
// snapshots takes its replicas this way (internal/server/snapshots.go), so
// that two such cuts, or a crashed one and its retry, never share an epoch.
func (w *writer) detachVolume(req *storpb.DetachVolumeRequest) (proto.Message, error) {
	v, err := w.VolumeByRef(req.Volume)
	if err != nil {
		return nil, err
	}
	if req.NodeId != "" {
		if err := CheckNodeID(fmt.Sprintf("detach volume %q: node id", v.Name), req.NodeId); err != nil {
			return nil, err
		}
	}
	switch {
	case req.FenceDetached && v.Attachment != nil:
		return nil, fmt.Errorf("%w: volume %q is attached to node %q; only a detached volume is fenced without an attach",
			ErrFailedPrecondition, v.Name, v.Attachment.NodeId)
	case req.FenceDetached && req.NodeId != "":
		return nil, fmt.Errorf("%w: fence a detached volume: node id %q given; a fence names no node", ErrInvalidArgument, req.NodeId)
	case req.FenceDetached:
	case v.Attachment == nil || (req.NodeId != "" && v.Attachment.NodeId != req.NodeId):
		return v, nil // not attached there: nothing to do
	}
	v.Epoch++
	v.Attachment = nil
	w.put(bucketVolumes, v.Id, v)
	return v, nil
}

// setReplicaState applies a data-path report (the transitions and their
// rules are in replicastate.go). Only the current epoch may change the
// replica set. A REBUILDING request that carries a total is a progress
// report of a rebuild under way, not a transition.
func (w *writer) setReplicaState(at int64, req *storpb.SetReplicaStateRequest) (proto.Message, error) {
	v, err := w.Volume(req.VolumeId)
	if err != nil {
		return nil, err
	}
	if req.Epoch != v.Epoch {
		return nil, fmt.Errorf("%w: volume %q is at epoch %d, the request carries %d", ErrStaleEpoch, v.Name, v.Epoch, req.Epoch)
	}
	r := findReplica(v, req.ReplicaId)
	if r == nil {
		return nil, fmt.Errorf("%w: volume %q has no replica %q", ErrNotFound, v.Name, req.ReplicaId)
	}
	var ev replicaEvent
	switch req.State {
	case storpb.ReplicaState_REPLICA_STATE_FAULTY:
		ev = eventFault
	case storpb.ReplicaState_REPLICA_STATE_REBUILDING:
		if req.RebuildTotalBytes > 0 {
			if err := recordProgress(v, r, req.Generation, req.RebuildDoneBytes, req.RebuildTotalBytes, req.RebuildResumeOffset); err != nil {
				return nil, err
			}
			w.put(bucketVolumes, v.Id, v)
			return v, nil
		}
		ev = eventRebuild
	case storpb.ReplicaState_REPLICA_STATE_HEALTHY:
		ev = eventRebuilt
	default:
		return nil, fmt.Errorf("%w: replica state %v", ErrInvalidArgument, req.State)
	}
	gen := v.Generation
	if err := moveReplica(v, r, ev, at, req.Generation); err != nil {
		return nil, err
	}
	if v.Generation != gen {
		w.put(bucketVolumes, v.Id, v)
	}
	return v, nil
}

func findReplica(v *storpb.Volume, id string) *storpb.Replica {
	for _, r := range v.Replicas {
		if r.Id == id {
			return r
		}
	}
	return nil
}

func healthyCount(v *storpb.Volume) int {
	n := 0
	for _, r := range v.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			n++
		}
	}
	return n
}

// replaceReplica removes a replica and/or adds a new one, which starts as
// REBUILDING with a full rebuild ahead (newReplica). The last healthy
// replica is never removed. The removed replica's snapshot copies go with
// it (loseReplica); unless repair is set (the leader replacing a replica
// unhealthy too long), a replica whose server is up and that holds the
// last copy of a ready snapshot is not removed (refuseLastCopies).
func (w *writer) replaceReplica(at int64, newID string, req *storpb.ReplaceReplicaRequest, repair bool) (proto.Message, error) {
	if req.ServerId != "" {
		if err := CheckServerID("replace replica: server id", req.ServerId); err != nil {
			return nil, err
		}
	}
	v, err := w.VolumeByRef(req.Volume)
	if err != nil {
		return nil, err
	}
	if req.ExpectGeneration != 0 && v.Generation != req.ExpectGeneration {
		return nil, fmt.Errorf("%w: volume %q changed: its replica-set generation is %d, not %d", ErrFailedPrecondition, v.Name, v.Generation, req.ExpectGeneration)
	}
	var old *storpb.Replica
	if req.ReplicaId != "" {
		if old = findReplica(v, req.ReplicaId); old == nil {
			return nil, fmt.Errorf("%w: volume %q has no replica %q", ErrNotFound, v.Name, req.ReplicaId)
		}
		if old.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && healthyCount(v) == 1 {
			return nil, fmt.Errorf("%w: replica %q is the last healthy replica of volume %q", ErrFailedPrecondition, old.Id, v.Name)
		}
		if !repair {
			if err := w.refuseLastCopies(v, old); err != nil {
				return nil, err
			}
		}
	} else if req.RemoveOnly {
		return nil, fmt.Errorf("%w: remove needs a replica id", ErrInvalidArgument)
	}
	var keep []*storpb.Replica
	var existing []string
	for _, r := range v.Replicas {
		if r != old {
			keep = append(keep, r)
		}
		// A replica lost with its server (ServerRemoved) takes no room
		// there: a server removed and joined again under its id (a new
		// data disk) can hold its replacement. (Only with the leader's
		// flag: a version before it placed as if it did.)
		if r != old || !r.ServerRemoved || !req.LostReplicaFreesItsServer {
			existing = append(existing, r.ServerId)
		}
	}
	var added string // the new replica's server
	if !req.RemoveOnly {
		if old == nil && len(v.Replicas) >= int(v.ReplicaCount) {
			extra := req.DrainExtra && len(v.Replicas) == int(v.ReplicaCount)
			if extra {
				if extra, err = w.onDrainingServer(v); err != nil {
					return nil, err
				}
			}
			if !extra {
				return nil, fmt.Errorf("%w: volume %q already has %d replicas", ErrFailedPrecondition, v.Name, len(v.Replicas))
			}
		}
		if newID == "" {
			return nil, fmt.Errorf("%w: replace-replica without a new replica id", ErrCorrupt)
		}
		servers, err := w.Servers()
		if err != nil {
			return nil, err
		}
		if req.ServerId != "" {
			servers = slices.DeleteFunc(servers, func(s *storpb.Server) bool { return s.Id != req.ServerId })
			if len(servers) == 0 {
				return nil, fmt.Errorf("%w: server %q", ErrNotFound, req.ServerId)
			}
		}
		percent, err := w.overProvisioningPercent()
		if err != nil {
			return nil, err
		}
		chosen, err := Place(servers, PlaceRequest{
			Replicas: 1, SizeBytes: v.SizeBytes, Existing: existing,
			Accessibility:           &storpb.TopologyRequirement{Requisite: v.Accessibility.GetRequisite()},
			OverProvisioningPercent: percent,
		})
		if err != nil {
			return nil, fmt.Errorf("volume %q: new replica: %w", v.Name, err)
		}
		added = chosen[0]
	}
	v.Generation++
	if added != "" {
		keep = append(keep, newReplica(v, newID, added, storpb.ReplicaState_REPLICA_STATE_REBUILDING, at))
		w.addAllocated([]string{added}, int64(v.SizeBytes))
	}
	if old != nil && !old.ServerRemoved {
		w.addAllocated([]string{old.ServerId}, -int64(v.SizeBytes))
	}
	v.Replicas = keep
	if old != nil {
		if err := w.loseReplica(v, old.Id, "its replica was removed from the volume"); err != nil {
			return nil, err
		}
	}
	if err := w.finishClone(v); err != nil {
		return nil, err
	}
	w.put(bucketVolumes, v.Id, v)
	return v, nil
}

// onDrainingServer reports whether a replica of v is on a draining server.
func (w *writer) onDrainingServer(v *storpb.Volume) (bool, error) {
	for _, r := range v.Replicas {
		s, err := w.Server(r.ServerId)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		if s.Draining {
			return true, nil
		}
	}
	return false, nil
}

// describeAttachment says where a volume is attached, for errors.
func describeAttachment(a *storpb.Attachment) string {
	if a == nil {
		return "it is not attached"
	}
	return fmt.Sprintf("it is attached to node %q", a.NodeId)
}
