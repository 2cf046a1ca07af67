package engine_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
)

// refusingVolumes answers the first n fault reports (SetReplicaState to
// FAULTY) with code, without passing them on, as a control plane with a
// failing leader or a broken forwarder would; n < 0 refuses them all.
type refusingVolumes struct {
	storpb.VolumeServiceClient
	code codes.Code

	mu      sync.Mutex
	n       int
	refused int
}

func (r *refusingVolumes) SetReplicaState(ctx context.Context, in *storpb.SetReplicaStateRequest, opts ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	if in.State == storpb.ReplicaState_REPLICA_STATE_FAULTY {
		r.mu.Lock()
		refuse := r.n < 0 || r.refused < r.n
		if refuse {
			r.refused++
		}
		r.mu.Unlock()
		if refuse {
			return nil, status.Error(r.code, "injected")
		}
	}
	return r.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
}

// TestFailedReplicaIsRecordedOrTheEngineStops: whatever the control plane
// answers to a fault report, a replica that missed a write is either
// committed faulty before the write returns, or the engine stops serving;
// it never stays in the read set holding old data.
func TestFailedReplicaIsRecordedOrTheEngineStops(t *testing.T) {
	cases := []struct {
		name  string
		code  codes.Code
		n     int  // refused reports (-1: all)
		acked bool // the write is acknowledged (else the engine stops)
	}{
		{"internal, then recorded", codes.Internal, 2, true},
		{"canceled, then recorded", codes.Canceled, 1, true},
		{"unknown, then recorded", codes.Unknown, 1, true},
		{"internal until the fault timeout", codes.Internal, -1, false},
		{"deadline exceeded until the fault timeout", codes.DeadlineExceeded, -1, false},
		{"permission denied", codes.PermissionDenied, -1, false},
		{"invalid argument", codes.InvalidArgument, -1, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			cfg := f.config("n1")
			refusing := &refusingVolumes{VolumeServiceClient: f.client.Volumes, code: tc.code, n: tc.n}
			cfg.Control.Volumes = refusing
			cfg.FaultTimeout = 500 * time.Millisecond
			// Reads prefer replica 2, the one that will miss the write.
			cfg.LocalServerID = f.vol.Replicas[2].ServerId
			e := f.open(cfg)
			old := randomBytes(20, 4096)
			if err := e.WriteAt(ctx10(t), old, 0, false); err != nil {
				t.Fatal(err)
			}

			r2 := f.replica(2)
			r2.mu.Lock()
			r2.failIO = true
			r2.mu.Unlock()
			data := randomBytes(21, 4096)
			err := e.WriteAt(ctx10(t), data, 0, false)
			r2.mu.Lock()
			r2.failIO = false // it answers again, with the old block
			r2.mu.Unlock()

			state := f.volume().Replicas[2].State
			got := make([]byte, 4096)
			rerr := e.ReadAt(ctx10(t), got, 0)
			if tc.acked {
				if err != nil {
					t.Fatalf("write: %v, want it acknowledged once the fault was recorded", err)
				}
				if state != storpb.ReplicaState_REPLICA_STATE_FAULTY {
					t.Fatalf("write acknowledged with replica 2 %v", state)
				}
				if rerr != nil || !bytes.Equal(got, data) {
					t.Fatalf("read after the write: %v, acknowledged data %v", rerr, bytes.Equal(got, data))
				}
				return
			}
			if !errors.Is(err, engine.ErrIO) {
				t.Fatalf("write: %v, want ErrIO", err)
			}
			if state != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				t.Fatalf("replica 2 is %v; the control plane refused every report", state)
			}
			// Replicas 0 and 1 hold the new block, replica 2 the old one:
			// the engine must not serve either as the volume's content.
			if !errors.Is(rerr, engine.ErrIO) {
				t.Fatalf("read after an unrecorded fault: %v (old block %v, new block %v), want ErrIO: the engine must stop",
					rerr, bytes.Equal(got, old), bytes.Equal(got, data))
			}
			if err := e.WriteAt(ctx10(t), data, 8192, false); !errors.Is(err, engine.ErrIO) {
				t.Fatalf("write after an unrecorded fault: %v, want ErrIO", err)
			}
		})
	}
}
