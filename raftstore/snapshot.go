package raftstore

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// Snapshots and clones in the state machine (DESIGN.md "Snapshots,
// clones, expansion"):
//
//   - CreateSnapshot records the snapshot with one PENDING entry per healthy
//     replica of the volume and adds its id to the volume's
//     pending_snapshot_ids, which reaches the attached engine through its
//     watch (a volume change). The data path cuts the layers and reports
//     through RecordSnapshotCut; the snapshot is ready when no replica is
//     PENDING and at least one has CUT, failed when none could.
//   - Every cut of one snapshot must be made at the same volume epoch (the
//     first recorded cut fixes cut_epoch), and every epoch has at most one
//     writer: an attach raises the epoch for its engine, a detach raises it
//     so that no engine (nor a zombie of the last one) holds it, and a
//     server cutting a detached volume's snapshots first raises it for
//     itself (DetachVolume with fence_detached) and reconciles the
//     replicas. The one engine of an epoch cuts each snapshot at one point
//     (replica/engine/snapshot.go), so cuts recorded at one epoch are cuts
//     at the same point. A cut reported at another epoch is recorded as
//     MISSED. On a replica the layer is named replica.LayerName(snapshot
//     id, epoch of the cut), so a cut at one epoch is never taken for a
//     cut at another (a stray layer is merged away by its server).
//   - A replica that leaves the volume takes its copies with it (its
//     server deletes it with its layers, and a new replica is rebuilt with
//     the head only): loseReplica, called by every path that takes a
//     replica out (replaceReplica, its server removed), turns its PENDING
//     entries MISSED and its CUT entries LOST, so no record names a copy
//     that is gone, and a snapshot left with no CUT copy is failed (a
//     clone from it is refused). An operator's or the API's removal of the
//     replica that holds the last CUT copy of a ready snapshot, while its
//     server is up, is refused instead (lastCopies); the leader's repair
//     of a replica unhealthy too long is not (package doc, "Snapshots
//     and replicas that leave").
//   - A clone (CreateVolume with a content source) starts CREATING with
//     clone_snapshot_id naming what its replicas are filled from; a volume
//     source is snapshotted implicitly (snapshot id "<clone id>-source").
//     RecordCloneCopied marks replicas filled; the clone becomes AVAILABLE
//     when all are, and its implicit snapshot is then deleted.
//   - Snapshots outlive their volume: a volume deleted while it has
//     snapshots (implicit ones included) is kept as a tombstone, state
//     DELETED, whose replicas still serve them, and removeSnapshot removes
//     it with its last snapshot (volumestate.go).

const (
	snapPending = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING
	snapCut     = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT
	snapMissed  = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED
	snapLost    = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST
)

// ImplicitSnapshotID is the id of the snapshot a clone from a volume takes.
func ImplicitSnapshotID(cloneID string) string { return cloneID + "-source" }

// SnapshotServes reports whether replica id holds snapshot s's layer (and
// may serve it).
func SnapshotServes(s *storpb.Snapshot, replicaID string) bool {
	for _, r := range s.Replicas {
		if r.ReplicaId == replicaID {
			return r.State == snapCut
		}
	}
	return false
}

// newSnapshot builds the record of a snapshot of v: PENDING on every
// healthy replica. It writes nothing.
func newSnapshot(at int64, id, name string, v *storpb.Volume) (*storpb.Snapshot, error) {
	if err := checkVolume(v, actSnapshot); err != nil {
		return nil, err
	}
	s := &storpb.Snapshot{Id: id, Name: name, VolumeId: v.Id, CreatedUnixNano: at, SizeBytes: v.SizeBytes}
	for _, r := range v.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && !r.ServerRemoved {
			s.Replicas = append(s.Replicas, &storpb.SnapshotReplica{ReplicaId: r.Id, ServerId: r.ServerId, State: snapPending})
		}
	}
	if len(s.Replicas) == 0 {
		return nil, fmt.Errorf("%w: volume %q has no healthy replica to snapshot", ErrFailedPrecondition, v.Name)
	}
	resolveSnapshot(s)
	return s, nil
}

// resolveSnapshot recomputes ready_to_use, failed and status_message from
// the replicas' entries. It reports whether any replica is still pending.
// The snapshot's whole state follows from its entries:
//
//	some PENDING                 waiting (neither ready nor failed)
//	none PENDING, some CUT       ready
//	none PENDING, none CUT       failed: no replica could cut it, or every
//	                             copy was LOST with the replica that held it
//
// An entry moves only PENDING -> CUT or MISSED (recordCut, loseReplica)
// and CUT -> LOST (loseReplica), so a ready snapshot stays ready until
// its last copy is lost, and a failed one never becomes ready.
func resolveSnapshot(s *storpb.Snapshot) (pending bool) {
	var waiting, gone []string
	cut, lost := 0, 0
	for _, r := range s.Replicas {
		switch r.State {
		case snapPending:
			waiting = append(waiting, fmt.Sprintf("%s (server %s)", r.ReplicaId, r.ServerId))
		case snapCut:
			cut++
		case snapMissed:
			gone = append(gone, fmt.Sprintf("%s: %s", r.ReplicaId, r.Reason))
		case snapLost:
			lost++
			gone = append(gone, fmt.Sprintf("%s: %s", r.ReplicaId, r.Reason))
		}
	}
	s.ReadyToUse, s.Failed = false, false
	switch {
	case len(waiting) > 0:
		s.StatusMessage = "waiting for replicas to cut the snapshot: " + strings.Join(waiting, ", ")
	case cut == 0 && lost > 0:
		s.Failed = true
		s.StatusMessage = "every copy of the snapshot is lost: " + strings.Join(gone, "; ")
	case cut == 0:
		s.Failed = true
		s.StatusMessage = "no replica could cut the snapshot: " + strings.Join(gone, "; ")
	default:
		s.ReadyToUse = true
		s.StatusMessage = ""
	}
	return len(waiting) > 0
}

func (w *writer) createSnapshot(at int64, id string, req *storpb.CreateSnapshotRequest) (proto.Message, error) {
	if err := ValidateName("snapshot", req.Name); err != nil {
		return nil, err
	}
	if req.VolumeId == "" {
		return nil, fmt.Errorf("%w: snapshot %q: source volume id is empty", ErrInvalidArgument, req.Name)
	}
	if existing, err := w.SnapshotByRef(&storpb.SnapshotRef{Name: req.Name}); err == nil {
		if existing.VolumeId != req.VolumeId {
			return nil, fmt.Errorf("%w: snapshot %q exists for volume %q", ErrAlreadyExists, req.Name, existing.VolumeId)
		}
		return existing, nil
	}
	if id == "" {
		return nil, fmt.Errorf("%w: create-snapshot without a new snapshot id", ErrCorrupt)
	}
	v, err := w.Volume(req.VolumeId)
	if err != nil {
		return nil, err
	}
	if err := w.checkSnapshotRoom(v); err != nil {
		return nil, fmt.Errorf("snapshot %q: %w", req.Name, err)
	}
	s, err := newSnapshot(at, id, req.Name, v)
	if err != nil {
		return nil, err
	}
	w.addSnapshot(s, v)
	return s, nil
}

// checkSnapshotRoom refuses one more snapshot of v when it has
// MaxSnapshotsPerVolume.
func (w *writer) checkSnapshotRoom(v *storpb.Volume) error {
	n, err := w.snapshotCount(v.Id)
	if err != nil {
		return err
	}
	if n >= MaxSnapshotsPerVolume {
		return fmt.Errorf("%w: volume %q has %d snapshots, the limit is %d; delete one first", ErrResourceExhausted, v.Name, n, MaxSnapshotsPerVolume)
	}
	return nil
}

// addSnapshot stores a new snapshot record and names it pending on v.
func (w *writer) addSnapshot(s *storpb.Snapshot, v *storpb.Volume) {
	v.PendingSnapshotIds = append(v.PendingSnapshotIds, s.Id)
	w.put(bucketSnapshots, s.Id, s)
	w.putRaw(bucketSnapshotNames, s.Name, s.Id)
	w.putVolume(v)
}

// putVolume stores v, changed as a side effect of a snapshot command, and
// names it for the watchers (the attached engine learns of pending
// snapshots this way).
func (w *writer) putVolume(v *storpb.Volume) {
	w.put(bucketVolumes, v.Id, v)
	w.touch(v.Id)
}

// touch names volume id, changed or removed as a side effect of the
// command being applied, for the watchers.
func (w *writer) touch(id string) {
	if !slices.Contains(w.lastTouched, id) {
		w.lastTouched = append(w.lastTouched, id)
	}
}

// removeSnapshot deletes a snapshot record and un-pends it on its volume
// (v, when the caller holds it, else it is read). The last snapshot of a
// deleted volume takes the volume with it (volumestate.go).
func (w *writer) removeSnapshot(s *storpb.Snapshot, v *storpb.Volume) error {
	if v == nil {
		var err error
		if v, err = w.Volume(s.VolumeId); err != nil {
			return err
		}
	}
	last := false
	if IsDeleted(v) {
		n, err := w.snapshotCount(v.Id)
		if err != nil {
			return err
		}
		last = n == 1 // s is the one left
	}
	if i := slices.Index(v.PendingSnapshotIds, s.Id); i >= 0 {
		v.PendingSnapshotIds = slices.Delete(v.PendingSnapshotIds, i, i+1)
		w.putVolume(v)
	}
	w.del(bucketSnapshots, s.Id)
	w.del(bucketSnapshotNames, s.Name)
	if last {
		w.removeVolume(v)
		w.touch(v.Id)
	}
	return nil
}

func (w *writer) deleteSnapshot(ref *storpb.SnapshotRef) (proto.Message, error) {
	s, err := w.SnapshotByRef(ref)
	if err != nil {
		return nil, err
	}
	if v, err := w.cloneCopying(s.Id); err != nil || v != nil {
		if err == nil {
			err = fmt.Errorf("%w: snapshot %q has clone %q still copying from it", ErrFailedPrecondition, s.Name, v.Name)
		}
		return nil, err
	}
	if err := w.removeSnapshot(s, nil); err != nil {
		return nil, err
	}
	return s, nil
}

// cloneCopying returns a clone still being filled from snapshot id
// (CREATING), or nil. It walks every volume, but decodes only the records
// that hold id's bytes (a clone's names its snapshot), so that deleting
// a snapshot in a cluster of 10,000 volumes does not decode 10,000
// volume records.
func (r *Reader) cloneCopying(id string) (*storpb.Volume, error) {
	c := r.tx.Bucket(bucketVolumes).Cursor()
	for k, b := c.First(); k != nil; k, b = c.Next() {
		if !bytes.Contains(b, []byte(id)) {
			continue
		}
		v := &storpb.Volume{}
		if err := proto.Unmarshal(b, v); err != nil {
			return nil, fmt.Errorf("%w: volume %q: %v", ErrCorrupt, k, err)
		}
		if v.State == storpb.VolumeState_VOLUME_STATE_CREATING && v.CloneSnapshotId == id {
			return v, nil
		}
	}
	return nil, nil
}

// cloneFailed is why clone v, filled from snapshot s, cannot be filled
// ("" while it can): s failed (no replica cut it, or every copy of it was
// lost), and nothing fills v's replicas without their copy. If some have
// theirs, removing the others finishes v (finishClone); if none, v can
// only be deleted.
func cloneFailed(v *storpb.Volume, s *storpb.Snapshot) string {
	if v.State != storpb.VolumeState_VOLUME_STATE_CREATING || s == nil || !s.Failed {
		return ""
	}
	what := fmt.Sprintf("snapshot %q", s.Name)
	if s.ImplicitForVolumeId != "" {
		what = "the snapshot of its source volume"
	}
	kept, filled := 0, 0
	for _, r := range v.Replicas {
		if !r.ServerRemoved {
			kept++
			if slices.Contains(v.CloneDoneReplicaIds, r.Id) {
				filled++
			}
		}
	}
	if filled > 0 {
		return fmt.Sprintf("volume %q cannot be filled further: %s failed (%s); %d of its %d replicas are filled: remove the others (stor-ctl replica remove) to finish it from those, or delete it",
			v.Name, what, s.StatusMessage, filled, kept)
	}
	return fmt.Sprintf("volume %q can never be filled: %s failed (%s); delete it, and restore from another snapshot", v.Name, what, s.StatusMessage)
}

// recordCloneFailures records a CloneFailed event on each clone left
// being filled from a snapshot that failed in the command just applied
// (w.failedSnapshots), once the command is done: a clone it finished
// meanwhile (its unfilled replicas removed with their server) is not
// failed. One pass over the volumes serves every snapshot that failed (a
// removed server can fail many at once); with few, only the records that
// name one are decoded, as in cloneCopying.
func (w *writer) recordCloneFailures() {
	failed := w.failedSnapshots
	if len(failed) == 0 {
		return
	}
	w.failedSnapshots = nil
	ids := slices.Sorted(maps.Keys(failed))
	c := w.tx.Bucket(bucketVolumes).Cursor()
	for k, b := c.First(); k != nil; k, b = c.Next() {
		if len(ids) <= 8 && !slices.ContainsFunc(ids, func(id string) bool { return bytes.Contains(b, []byte(id)) }) {
			continue
		}
		v := &storpb.Volume{}
		if proto.Unmarshal(b, v) != nil {
			continue // every other read of it reports it
		}
		if why := cloneFailed(v, failed[v.CloneSnapshotId]); why != "" {
			w.event(&storpb.Event{VolumeId: v.Id, VolumeName: v.Name, Reason: "CloneFailed", Message: clip(why, 2*maxEventReason)})
		}
	}
}

// recordCut applies a data-path report of cuts (see the file comment).
func (w *writer) recordCut(req *storpb.RecordSnapshotCutRequest) (proto.Message, error) {
	s, err := w.Snapshot(req.SnapshotId)
	if err != nil {
		return nil, err
	}
	v, err := w.Volume(s.VolumeId)
	if err != nil {
		return nil, err
	}
	if len(req.CutReplicaIds) > 0 && req.Epoch != v.Epoch {
		return nil, fmt.Errorf("%w: volume %q is at epoch %d, the cuts were made at %d", ErrStaleEpoch, v.Name, v.Epoch, req.Epoch)
	}
	for _, r := range s.Replicas {
		if r.State != snapPending {
			continue
		}
		switch {
		case slices.Contains(req.CutReplicaIds, r.ReplicaId):
			if !cutAllowed(s, req.Epoch) {
				r.State = snapMissed
				r.Reason = fmt.Sprintf("cut at epoch %d, after the volume was attached again (the other replicas cut at epoch %d)", req.Epoch, s.CutEpoch)
				continue
			}
			r.State, s.CutEpoch = snapCut, req.Epoch
		case slices.Contains(req.MissedReplicaIds, r.ReplicaId):
			r.State, r.Reason = snapMissed, req.Reason
		}
	}
	w.putResolved(s, v)
	return s, nil
}

// putResolved stores s with its status recomputed, and takes it off v's
// pending list once no replica is pending.
func (w *writer) putResolved(s *storpb.Snapshot, v *storpb.Volume) {
	if !resolveSnapshot(s) {
		if i := slices.Index(v.PendingSnapshotIds, s.Id); i >= 0 {
			v.PendingSnapshotIds = slices.Delete(v.PendingSnapshotIds, i, i+1)
			w.putVolume(v)
		}
	}
	w.put(bucketSnapshots, s.Id, s)
}

// loseReplica records that replica id left volume v and took its copies
// with it: in every snapshot of v its PENDING entry becomes MISSED (it
// will never cut) and its CUT entry LOST, each with reason; a snapshot
// left with no CUT copy is failed (resolveSnapshot). The caller stores v.
func (w *writer) loseReplica(v *storpb.Volume, id, reason string) error {
	snaps, _, err := w.Snapshots(v.Id, "", 0)
	if err != nil {
		return err
	}
	for _, s := range snaps {
		changed := false
		for _, r := range s.Replicas {
			if r.ReplicaId != id {
				continue
			}
			switch r.State {
			case snapPending:
				r.State, r.Reason = snapMissed, reason+" before it cut the snapshot"
				changed = true
			case snapCut:
				r.State, r.Reason = snapLost, reason+"; the copy went with it"
				changed = true
			}
		}
		if changed {
			w.putResolved(s, v)
		}
	}
	return nil
}

// lastCopies lists the ready snapshots of volume v whose only CUT copy is
// replica id's: removing that replica would lose them.
func (r *Reader) lastCopies(v *storpb.Volume, id string) ([]*storpb.Snapshot, error) {
	snaps, _, err := r.Snapshots(v.Id, "", 0)
	if err != nil {
		return nil, err
	}
	var out []*storpb.Snapshot
	for _, s := range snaps {
		if !s.ReadyToUse || !SnapshotServes(s, id) {
			continue
		}
		others := slices.ContainsFunc(s.Replicas, func(e *storpb.SnapshotReplica) bool {
			return e.ReplicaId != id && e.State == snapCut
		})
		if !others {
			out = append(out, s)
		}
	}
	return out, nil
}

// refuseLastCopies is the operator's guard (replaceReplica, not the
// leader's repair): replica old of v may not be removed while its server
// is up and it holds the last copy of a ready snapshot.
func (w *writer) refuseLastCopies(v *storpb.Volume, old *storpb.Replica) error {
	if old.ServerRemoved {
		return nil // its data went with its server
	}
	if srv, err := w.Server(old.ServerId); err != nil || srv.State != storpb.ServerState_SERVER_STATE_UP {
		return nil // down: what it holds cannot be read now; repairing the head comes first
	}
	last, err := w.lastCopies(v, old.Id)
	if err != nil || len(last) == 0 {
		return err
	}
	s := last[0]
	wait := ""
	if s.ImplicitForVolumeId != "" {
		wait = fmt.Sprintf(", or wait until clone %q is filled (its implicit snapshot is then deleted)", s.ImplicitForVolumeId)
	}
	more := ""
	if len(last) > 1 {
		more = fmt.Sprintf(" (and the last copy of %d more)", len(last)-1)
	}
	return fmt.Errorf("%w: replica %q of volume %q holds the last copy of snapshot %q%s; removing it would lose the snapshot: delete the snapshot first (clone it to a new volume to keep its data)%s",
		ErrFailedPrecondition, old.Id, v.Name, s.Name, more, wait)
}

// cloneSource is what prepareClone found: the snapshot the clone is filled
// from, and for a volume source the implicit snapshot to record.
type cloneSource struct {
	snapshotID string
	implicit   *storpb.Snapshot
	srcVolume  *storpb.Volume
}

// prepareClone validates a content source and returns how the clone is
// filled (nil: no source). It writes nothing.
func (w *writer) prepareClone(at int64, cloneID string, src *storpb.ContentSource, size uint64) (*cloneSource, error) {
	switch s := src.GetSource().(type) {
	case nil:
		return nil, nil
	case *storpb.ContentSource_SnapshotId:
		snap, err := w.Snapshot(s.SnapshotId)
		if err != nil {
			return nil, fmt.Errorf("content source: %w", err)
		}
		if snap.Failed {
			return nil, fmt.Errorf("%w: content source: snapshot %q failed: %s", ErrFailedPrecondition, snap.Name, snap.StatusMessage)
		}
		if size < snap.SizeBytes {
			return nil, fmt.Errorf("%w: size %d is smaller than its content source (%d)", ErrInvalidArgument, size, snap.SizeBytes)
		}
		return &cloneSource{snapshotID: snap.Id}, nil
	case *storpb.ContentSource_VolumeId:
		vol, err := w.Volume(s.VolumeId)
		if err != nil {
			return nil, fmt.Errorf("content source: %w", err)
		}
		if err := checkVolume(vol, actCloneFrom); err != nil {
			return nil, fmt.Errorf("content source: %w", err)
		}
		if size < vol.SizeBytes {
			return nil, fmt.Errorf("%w: size %d is smaller than its content source (%d)", ErrInvalidArgument, size, vol.SizeBytes)
		}
		if err := w.checkSnapshotRoom(vol); err != nil {
			return nil, fmt.Errorf("content source: %w", err)
		}
		id := ImplicitSnapshotID(cloneID)
		snap, err := newSnapshot(at, id, "clone-source-"+cloneID, vol)
		if err != nil {
			return nil, fmt.Errorf("content source: %w", err)
		}
		snap.ImplicitForVolumeId = cloneID
		return &cloneSource{snapshotID: id, implicit: snap, srcVolume: vol}, nil
	}
	return nil, fmt.Errorf("%w: unknown content source", ErrInvalidArgument)
}

// startClone makes v a clone being filled from c (if any): CREATING, and
// the implicit snapshot recorded.
func (w *writer) startClone(v *storpb.Volume, c *cloneSource) {
	if c == nil {
		return
	}
	v.State = storpb.VolumeState_VOLUME_STATE_CREATING
	v.CloneSnapshotId = c.snapshotID
	if c.implicit != nil {
		w.addSnapshot(c.implicit, c.srcVolume)
	}
}

// dropImplicitSnapshot deletes the implicit snapshot a clone being
// deleted (or done) was filled from.
func (w *writer) dropImplicitSnapshot(v *storpb.Volume) error {
	if v.CloneSnapshotId == "" {
		return nil
	}
	s, err := w.Snapshot(v.CloneSnapshotId)
	if err != nil || s.ImplicitForVolumeId != v.Id {
		return nil // a user's snapshot, or already gone
	}
	return w.removeSnapshot(s, nil)
}

func (w *writer) recordCloneCopied(req *storpb.RecordCloneCopiedRequest) (proto.Message, error) {
	v, err := w.Volume(req.VolumeId)
	if err != nil {
		return nil, err
	}
	if v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
		return v, nil // already done
	}
	if findReplica(v, req.ReplicaId) == nil {
		return nil, fmt.Errorf("%w: volume %q has no replica %q", ErrNotFound, v.Name, req.ReplicaId)
	}
	if !slices.Contains(v.CloneDoneReplicaIds, req.ReplicaId) {
		v.CloneDoneReplicaIds = append(v.CloneDoneReplicaIds, req.ReplicaId)
	}
	if err := w.finishClone(v); err != nil {
		return nil, err
	}
	w.put(bucketVolumes, v.Id, v)
	return v, nil
}

// finishClone makes clone v AVAILABLE, and drops its implicit snapshot,
// once every replica it keeps (not removed with its server) has its copy
// of the snapshot. A recorded copy can finish it, and so can a replica
// that leaves it (an operator's or a drain's removal, its server removed
// from the cluster) when it was the last one without a copy: nothing
// would record again, and the clone stayed CREATING for ever. v is
// changed in place; the caller stores it.
func (w *writer) finishClone(v *storpb.Volume) error {
	if v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
		return nil
	}
	kept := 0
	for _, r := range v.Replicas {
		if r.ServerRemoved {
			continue
		}
		if !slices.Contains(v.CloneDoneReplicaIds, r.Id) {
			return nil
		}
		kept++
	}
	if kept == 0 {
		return nil // every replica lost: no copy holds the snapshot
	}
	if err := w.dropImplicitSnapshot(v); err != nil {
		return err
	}
	v.State = storpb.VolumeState_VOLUME_STATE_AVAILABLE
	return nil
}

// cutAllowed reports whether a replica of s's volume may still cut s at
// epoch: no replica has cut yet, or they cut at that same epoch (no write
// can have happened in between). Otherwise the replica missed the cut.
func cutAllowed(s *storpb.Snapshot, epoch uint64) bool {
	for _, r := range s.Replicas {
		if r.State == snapCut {
			return s.CutEpoch == epoch
		}
	}
	return true
}
