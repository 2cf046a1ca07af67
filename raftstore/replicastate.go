package raftstore

import (
	"fmt"

	storpb "github.com/stor-io/stor/api/proto"
)

// The replica state machine: every change to a replica's state and rebuild
// bookkeeping is made here, by newReplica (a replica joins a volume),
// moveReplica (a transition, which bumps the volume's generation) and
// recordProgress (a rebuild reports progress, no new generation). This is
// the whole of it (package doc, "Replica states and rebuilds", says why):
//
//	from        event            to          generation  from_gen      resume      unhealthy_since
//	-           volume created   HEALTHY     v.gen       0             0           0
//	-           replica added    REBUILDING  new         0 (full)      0           at
//	HEALTHY     fault            FAULTY      new g       g             0           at
//	REBUILDING  fault            FAULTY      new         kept          0 (drop)    kept
//	FAULTY      fault            (no change)
//	FAULTY      rebuild          REBUILDING  new         kept          0           kept
//	REBUILDING  rebuild          (no change)
//	REBUILDING  progress         REBUILDING  kept        kept          max(kept,p) kept
//	REBUILDING  rebuilt          HEALTHY     new         0             0           0
//	HEALTHY     rebuilt          (no change)
//	any         server removed   FAULTY      new         0 (full)      0           at if HEALTHY, else kept
//
// from_gen is Replica.rebuild_from_generation and resume is
// Replica.rebuild_resume_offset. Refused (ErrFailedPrecondition, nothing
// changes): a fault of the last HEALTHY replica; a rebuild of a replica
// that is not FAULTY; rebuilt for a replica that is not REBUILDING at the
// generation its rebuild started at (a stale or superseded attempt);
// progress for a replica that is not REBUILDING, or (for a resume offset)
// from another attempt than the current one.
//
// What the fields mean after every transition:
//
//   - rebuild_from_generation, while FAULTY or REBUILDING, is where the
//     replica's rebuild starts, a fact about the replica that no failed
//     rebuild changes: the generation g at which it stopped being HEALTHY,
//     or 0 ("full") if it has not been HEALTHY since it was added (or its
//     data went with its server). It holds every write made at a
//     generation below g (one it took and then lost to a machine crash is
//     in its own dirty regions, which a delta copies too). A write that
//     failed on it is acknowledged only
//     after its fault is committed, and is first applied again, at the
//     engine's generation then (>= g), on the replicas that took it, so
//     their write history (WrittenSince(g): regions written at generation
//     >= g) names every write it may lack. A rebuild that fails and is
//     retried starts from the same g, however many faults later: the
//     replica missed the writes of its first absence as well as those of
//     the last. 0 while HEALTHY.
//   - rebuild_resume_offset is valid only while the replica stays
//     REBUILDING: a full rebuild copied and flushed everything below it,
//     and every write since reached the replica (it was in the write set).
//     A fault takes the replica out of the write set, so it may then miss
//     writes below the offset: every transition clears it, and progress
//     raises it only for the current attempt (the request's generation is
//     the replica's).
//   - rebuild_done_bytes, rebuild_total_bytes: the current attempt's
//     progress; 0 outside REBUILDING.

// replicaEvent is what happened to a replica.
type replicaEvent int

const (
	// eventFault: the replica failed (a write or read error, its server
	// down, its rebuild failed, it could not be opened).
	eventFault replicaEvent = iota
	// eventRebuild: a faulty replica starts rebuilding (again).
	eventRebuild
	// eventRebuilt: its rebuild completed.
	eventRebuilt
	// eventServerRemoved: its server left the cluster and its data with it.
	eventServerRemoved
)

func (ev replicaEvent) String() string {
	switch ev {
	case eventFault:
		return "fault"
	case eventRebuild:
		return "rebuild"
	case eventRebuilt:
		return "rebuilt"
	case eventServerRemoved:
		return "server removed"
	}
	return fmt.Sprintf("replicaEvent(%d)", int(ev))
}

// newReplica is a replica joining volume v at its current generation:
// HEALTHY when the volume is created (it is all there is), otherwise
// REBUILDING with a full rebuild ahead.
func newReplica(v *storpb.Volume, id, serverID string, state storpb.ReplicaState, at int64) *storpb.Replica {
	r := &storpb.Replica{Id: id, ServerId: serverID, State: state, Generation: v.Generation}
	if state != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		r.StateSinceUnixNano, r.UnhealthySinceUnixNano = at, at
	}
	return r
}

// moveReplica applies ev to replica r of volume v, in a new generation of
// v, or refuses it (see the table above). attempt is, for eventRebuilt, the
// replica's generation when the rebuild started. An event that finds the
// replica already in the state it leads to (a fault of a FAULTY replica, a
// rebuild of a REBUILDING one, the end of a rebuild of a HEALTHY one)
// changes nothing and is not refused: a report repeated, or raced by
// another.
func moveReplica(v *storpb.Volume, r *storpb.Replica, ev replicaEvent, at int64, attempt uint64) error {
	const (
		healthy    = storpb.ReplicaState_REPLICA_STATE_HEALTHY
		rebuilding = storpb.ReplicaState_REPLICA_STATE_REBUILDING
		faulty     = storpb.ReplicaState_REPLICA_STATE_FAULTY
	)
	prev := r.State
	switch ev {
	case eventFault:
		if prev == faulty {
			return nil
		}
		if prev == healthy && healthyCount(v) == 1 {
			return fmt.Errorf("%w: replica %q is the last healthy replica of volume %q", ErrFailedPrecondition, r.Id, v.Name)
		}
	case eventRebuild:
		if prev == rebuilding {
			return nil
		}
		if prev != faulty {
			return fmt.Errorf("%w: replica %q is %v; only a faulty replica starts rebuilding", ErrFailedPrecondition, r.Id, prev)
		}
	case eventRebuilt:
		if prev == healthy {
			return nil
		}
		if prev != rebuilding || r.Generation != attempt {
			return fmt.Errorf("%w: replica %q is %v at generation %d; a rebuild from generation %d cannot mark it healthy",
				ErrFailedPrecondition, r.Id, prev, r.Generation, attempt)
		}
	case eventServerRemoved:
	default:
		return fmt.Errorf("%w: replica event %v", ErrInvalidArgument, ev)
	}

	v.Generation++
	r.Generation, r.StateSinceUnixNano = v.Generation, at
	// Every transition ends the current attempt: its progress and its
	// checkpoint (see rebuild_resume_offset above).
	r.RebuildDoneBytes, r.RebuildTotalBytes, r.RebuildResumeOffset = 0, 0, 0
	switch ev {
	case eventFault:
		r.State = faulty
		if prev == healthy {
			r.RebuildFromGeneration = v.Generation
			r.UnhealthySinceUnixNano = at
		}
		// REBUILDING -> FAULTY keeps RebuildFromGeneration: the replica
		// has not been healthy since.
	case eventRebuild:
		r.State = rebuilding // RebuildFromGeneration kept
	case eventRebuilt:
		r.State, r.RebuildFromGeneration, r.UnhealthySinceUnixNano = healthy, 0, 0
	case eventServerRemoved:
		r.State, r.RebuildFromGeneration, r.ServerRemoved = faulty, 0, true
		if prev == healthy {
			r.UnhealthySinceUnixNano = at
		}
	}
	return nil
}

// recordProgress records a rebuild's progress on a REBUILDING replica
// without a new generation. attempt is the replica's generation when the
// rebuild started, or 0 from a reporter that does not say: its resume
// offset is then ignored (it could belong to an attempt before a fault,
// which the replica has since missed writes below).
func recordProgress(v *storpb.Volume, r *storpb.Replica, attempt, done, total, resume uint64) error {
	if r.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || (attempt != 0 && attempt != r.Generation) {
		return fmt.Errorf("%w: replica %q is %v at generation %d; progress of a rebuild from generation %d is stale",
			ErrFailedPrecondition, r.Id, r.State, r.Generation, attempt)
	}
	r.RebuildDoneBytes, r.RebuildTotalBytes = done, total
	if attempt != 0 {
		r.RebuildResumeOffset = max(r.RebuildResumeOffset, resume)
	}
	return nil
}
