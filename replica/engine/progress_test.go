package engine_test

import (
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
)

// TestProgressRequestNamesItsAttempt: a rebuild's progress report carries
// the replica's generation when the rebuild started, which the control
// plane requires before it records a checkpoint (a late report of an
// attempt that failed must not set the resume offset of the next one:
// raftstore/replicastate.go).
func TestProgressRequestNamesItsAttempt(t *testing.T) {
	r := &storpb.Replica{Id: "v-r2", Generation: 7, State: storpb.ReplicaState_REPLICA_STATE_REBUILDING}
	req := engine.ProgressRequest("v", r, 3, engine.Progress{Done: 4 << 20, Total: 8 << 20, ResumeOffset: 4 << 20})
	if req.VolumeId != "v" || req.ReplicaId != "v-r2" || req.Epoch != 3 || req.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		t.Fatalf("request %v: wrong volume, replica, epoch or state", req)
	}
	if req.Generation != 7 {
		t.Fatalf("request %v names attempt %d, want the replica's generation 7", req, req.Generation)
	}
	if req.RebuildResumeOffset != 4<<20 || req.RebuildDoneBytes != 4<<20 || req.RebuildTotalBytes != 8<<20 {
		t.Fatalf("request %v: progress not carried", req)
	}
	// A report before the total is known still reads as progress, not as
	// a request to start rebuilding.
	if req := engine.ProgressRequest("v", r, 3, engine.Progress{}); req.RebuildTotalBytes == 0 {
		t.Fatalf("request %v has no total: the control plane would take it for a rebuild start", req)
	}
}
