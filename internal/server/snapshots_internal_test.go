package server

import (
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

func TestStrayLayer(t *testing.T) {
	const (
		pending = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING
		cut     = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT
		missed  = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED
	)
	snap := func(st storpb.SnapshotReplicaState, cutEpoch uint64) *storpb.Snapshot {
		return &storpb.Snapshot{Id: "s", CutEpoch: cutEpoch, Replicas: []*storpb.SnapshotReplica{{ReplicaId: "r1", State: st}}}
	}
	for _, tc := range []struct {
		name       string
		s          *storpb.Snapshot
		replica    string
		layerEpoch uint64
		volEpoch   uint64
		merge      bool
	}{
		{"cut at the recorded epoch", snap(cut, 3), "r1", 3, 5, false},
		{"cut at another epoch", snap(cut, 3), "r1", 2, 5, true},
		{"pending, cut at the current epoch (record in flight)", snap(pending, 0), "r1", 5, 5, false},
		{"pending, cut at an epoch the volume left", snap(pending, 0), "r1", 4, 5, true},
		{"pending, cut at an epoch this view has not seen yet", snap(pending, 0), "r1", 6, 5, false},
		{"missed", snap(missed, 3), "r1", 3, 5, true},
		{"not in the snapshot", snap(cut, 3), "r9", 3, 5, true},
	} {
		why := strayLayer(tc.s, &storpb.Volume{Epoch: tc.volEpoch}, tc.replica, tc.layerEpoch)
		if (why != "") != tc.merge {
			t.Errorf("%s: strayLayer = %q, want merge %v", tc.name, why, tc.merge)
		}
	}
}
