package raftstore

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// The volume lifecycle: every change of a volume's state, and the removal
// of its record, is made here (the transitions) or by the function this
// table names; checkVolume states what each state allows. Kubernetes
// assumes a VolumeSnapshot outlives its source PersistentVolume (it can be
// restored after the claim is gone), so a volume deleted while it has
// snapshots is kept, as a tombstone, for them:
//
//	from               event                        to         by
//	-                  created                      AVAILABLE  createVolume
//	-                  created with a source        CREATING   createVolume (startClone)
//	CREATING           every replica's copy done    AVAILABLE  recordCloneCopied
//	CREATING/AVAILABLE delete, no snapshots         removed    deleteVolume
//	AVAILABLE          delete, with snapshots       DELETED    deleteVolume
//	DELETED            delete                       (no change: idempotent)
//	DELETED            its last snapshot deleted    removed    removeSnapshot (deleteSnapshot,
//	                                                           or a clone's implicit one dropped)
//
// Refused, nothing changes: deleting an attached volume
// (ErrFailedPrecondition: detach it first; a volume is detached before it
// is deleted, so a tombstone is never attached); expanding a volume with
// snapshots not yet cut (ErrFailedPrecondition: retry once they are cut,
// so that each snapshot holds the size it was taken at; expandVolume). A CREATING volume has no
// snapshots (it cannot be snapshotted, nor be a clone's source), so it is
// never kept.
//
// Removed: the record, its name and its replicas' allocation are dropped;
// every server deletes the replicas it holds for it (its data plane
// deletes replicas that are no longer placed on it), with their layers.
//
// DELETED (a tombstone), what each field means:
//
//   - name: still the name it had, for operators, but the volume_names
//     entry is gone: VolumeByName does not find it, and a new volume may
//     take the name. deleted_unix_nano is when it was deleted.
//   - replicas, epoch, generation: as for any volume. Replica states move
//     (replicastate.go), the leader repairs and replaces its replicas, the
//     servers rebuild them (a tombstone is detached), so a server that
//     dies does not take its snapshots' copies with it.
//   - pending_snapshot_ids: snapshots requested before the delete are cut
//     as for any detached volume (DetachVolume with fence_detached and
//     RecordSnapshotCut are allowed).
//   - Its snapshots are read and cloned from as before (CreateVolume with
//     a snapshot content source).
//   - Its replicas keep counting against their servers' allocation: they
//     are on disk until the volume is removed.
//
// checkVolume refuses what a user may no longer do with a tombstone, with
// ErrNotFound (the volume does not exist for its users) and a message that
// says why: attach, expand, snapshot, and clone from the volume itself.

// volumeAction is a user's request on an existing volume that its state
// may forbid.
type volumeAction int

const (
	actAttach volumeAction = iota
	actExpand
	actSnapshot
	actCloneFrom // the volume as a clone's content source
)

var volumeActionNames = map[volumeAction]string{
	actAttach: "attached", actExpand: "expanded", actSnapshot: "snapshotted", actCloneFrom: "cloned",
}

// checkVolume says whether v's state allows act:
//
//	state      attach              expand    snapshot            clone from
//	CREATING   FailedPrecondition  yes       FailedPrecondition  FailedPrecondition
//	AVAILABLE  yes                 yes       yes                 yes
//	DELETED    NotFound            NotFound  NotFound            NotFound
//
// (attach also has its own rules about where the volume is attached, in
// attachVolume.)
func checkVolume(v *storpb.Volume, act volumeAction) error {
	switch v.State {
	case storpb.VolumeState_VOLUME_STATE_AVAILABLE:
		return nil
	case storpb.VolumeState_VOLUME_STATE_DELETED:
		return fmt.Errorf("%w: volume %q (id %s) was deleted and cannot be %s; it is kept only until its snapshots are deleted (restore them with a new volume)",
			ErrNotFound, v.Name, v.Id, volumeActionNames[act])
	case storpb.VolumeState_VOLUME_STATE_CREATING:
		switch act {
		case actExpand:
			return nil
		case actAttach:
			return fmt.Errorf("%w: volume %q is a clone still being filled from its source (%d of %d replicas copied); it can be attached when the copy is done",
				ErrFailedPrecondition, v.Name, len(v.CloneDoneReplicaIds), len(v.Replicas))
		}
		return fmt.Errorf("%w: volume %q is still being filled from its content source; it can be %s when the copy is done",
			ErrFailedPrecondition, v.Name, volumeActionNames[act])
	}
	return fmt.Errorf("%w: volume %q is %v and cannot be %s", ErrFailedPrecondition, v.Name, v.State, volumeActionNames[act])
}

// IsDeleted reports whether v was deleted and is kept only for its
// snapshots (a tombstone).
func IsDeleted(v *storpb.Volume) bool {
	return v.GetState() == storpb.VolumeState_VOLUME_STATE_DELETED
}

// deleteVolume deletes a volume (see the table above): a volume with
// snapshots becomes a tombstone, any other is removed. Deleting a
// tombstone again changes nothing and answers it, so a retried delete
// succeeds.
func (w *writer) deleteVolume(at int64, ref *storpb.VolumeRef) (proto.Message, error) {
	v, err := w.VolumeByRef(ref)
	if err != nil {
		return nil, err
	}
	if IsDeleted(v) {
		return v, nil
	}
	if v.Attachment != nil {
		return nil, fmt.Errorf("%w: volume %q is attached to node %q", ErrFailedPrecondition, v.Name, v.Attachment.NodeId)
	}
	n, err := w.snapshotCount(v.Id)
	if err != nil {
		return nil, err
	}
	if n > 0 {
		v.State = storpb.VolumeState_VOLUME_STATE_DELETED
		v.DeletedUnixNano = at
		w.put(bucketVolumes, v.Id, v)
		w.del(bucketVolumeNames, v.Name)
		return v, nil
	}
	if err := w.dropImplicitSnapshot(v); err != nil {
		return nil, err
	}
	w.removeVolume(v)
	return v, nil
}

// removeVolume drops v's record, its name (unless v is a tombstone, whose
// name was freed when it was deleted and may name another volume now) and
// its replicas' allocation. The caller checked that nothing refers to it.
func (w *writer) removeVolume(v *storpb.Volume) {
	w.addAllocated(replicaServers(v), -int64(v.SizeBytes))
	w.del(bucketVolumes, v.Id)
	if !IsDeleted(v) {
		w.del(bucketVolumeNames, v.Name)
	}
}
