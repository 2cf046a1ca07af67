package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
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

// TestOpenGrowsReplicasExpandedWhileDetached: a volume expanded while no
// engine had it open has replicas smaller than its committed size; Open
// grows them before serving, so the new space takes writes on every
// replica.
func TestOpenGrowsReplicasExpandedWhileDetached(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if err := e.Close(ctx10(t), true); err != nil {
		t.Fatal(err)
	}
	if _, err := f.client.Volumes.ExpandVolume(ctx10(t), &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: f.vol.Id}, SizeBytes: 2 * volSize}); err != nil {
		t.Fatal(err)
	}
	e = f.open(f.config("n1"))
	if e.Size() != 2*volSize {
		t.Fatalf("engine size %d, want %d", e.Size(), 2*volSize)
	}
	data := randomBytes(30, 4096)
	if err := e.WriteAt(ctx10(t), data, 2*volSize-4096, false); err != nil {
		t.Fatalf("write in the space added while detached: %v", err)
	}
	for i := range 3 {
		got := f.replica(i).snapshot()
		if len(got) != 2*volSize || !bytes.Equal(got[2*volSize-4096:], data) {
			t.Fatalf("replica %d: %d bytes, holds the write: %v", i, len(got), len(got) == 2*volSize && bytes.Equal(got[2*volSize-4096:], data))
		}
	}
	if v := f.volume(); v.Generation != 1 {
		t.Fatalf("generation %d: growing at open marked a replica faulty", v.Generation)
	}
}

// TestReplicaRefusingAnInRangeRequestIsFaulty: the engine checked the
// range against the volume, so a replica that calls it invalid (here one
// left smaller than the volume) has failed: a write is acknowledged once
// it is recorded faulty, and a read goes to another replica.
func TestReplicaRefusingAnInRangeRequestIsFaulty(t *testing.T) {
	for _, op := range []string{"write", "read"} {
		t.Run(op, func(t *testing.T) {
			f := newFixture(t)
			cfg := f.config("n1")
			cfg.LocalServerID = f.vol.Replicas[2].ServerId // reads go to replica 2 first
			e := f.open(cfg)
			data := randomBytes(31, 4096)
			off := int64(volSize - 4096)
			if op == "read" {
				if err := e.WriteAt(ctx10(t), data, off, false); err != nil {
					t.Fatal(err)
				}
			}
			r2 := f.replica(2)
			r2.mu.Lock()
			r2.data = r2.data[:volSize/2] // it no longer reaches off
			r2.mu.Unlock()
			switch op {
			case "write":
				if err := e.WriteAt(ctx10(t), data, off, false); err != nil {
					t.Fatalf("write: %v, want it acknowledged without the refusing replica", err)
				}
			case "read":
				got := make([]byte, 4096)
				if err := e.ReadAt(ctx10(t), got, off); err != nil || !bytes.Equal(got, data) {
					t.Fatalf("read: %v (data %v), want it served by another replica", err, bytes.Equal(got, data))
				}
			}
			if s := f.volume().Replicas[2].State; s != storpb.ReplicaState_REPLICA_STATE_FAULTY {
				t.Fatalf("replica 2 refused an in-range %s and is %v", op, s)
			}
			got := make([]byte, 4096)
			if err := e.ReadAt(ctx10(t), got, off); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read back: %v (data %v)", err, bytes.Equal(got, data))
			}
		})
	}
}

// TestRejoiningReplicaIsGrownBeforeItJoins: a replica that was out of the
// set while the volume grew comes back smaller than it; the engine grows
// it before it joins the write set, so writes to the new space and its
// rebuild reach it, and it becomes healthy with every write.
func TestRejoiningReplicaIsGrownBeforeItJoins(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if err := e.WriteAt(ctx10(t), randomBytes(32, 1<<20), 0, false); err != nil {
		t.Fatal(err)
	}
	r2 := f.replica(2)
	r2.mu.Lock()
	r2.failIO = true
	r2.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(33, 4096), 4096, false); err != nil {
		t.Fatal(err)
	}
	if s := f.volume().Replicas[2].State; s != storpb.ReplicaState_REPLICA_STATE_FAULTY {
		t.Fatalf("replica 2 is %v", s)
	}
	if _, err := f.client.Volumes.ExpandVolume(ctx10(t), &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: f.vol.Id}, SizeBytes: 2 * volSize}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for e.Size() != 2*volSize {
		if time.Now().After(deadline) {
			t.Fatalf("engine size %d after expansion", e.Size())
		}
		time.Sleep(10 * time.Millisecond)
	}
	missed := randomBytes(34, 64<<10) // in the new space, while replica 2 is out
	if err := e.WriteAt(ctx10(t), missed, volSize+(1<<20), false); err != nil {
		t.Fatal(err)
	}
	r2.mu.Lock()
	r2.failIO = false
	r2.mu.Unlock()
	deadline = time.Now().Add(15 * time.Second)
	for f.volume().Replicas[2].State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		if time.Now().After(deadline) {
			t.Fatalf("replica 2 not healthy again: %v", f.volume().Replicas[2])
		}
		time.Sleep(50 * time.Millisecond)
	}
	last := randomBytes(35, 4096)
	if err := e.WriteAt(ctx10(t), last, 2*volSize-4096, false); err != nil {
		t.Fatalf("write at the end after the rejoin: %v", err)
	}
	a, b, c := f.replica(0).snapshot(), f.replica(1).snapshot(), r2.snapshot()
	if len(c) != 2*volSize || !bytes.Equal(a, b) || !bytes.Equal(a, c) {
		t.Fatalf("replicas differ after the rejoin (replica 2 has %d bytes)", len(c))
	}
}

// zeroConn is a replica that keeps no data: it records the WriteZeroes and
// Trim it is sent and, as the store does, refuses one longer than
// replica.MaxZeroes.
type zeroConn struct {
	engine.ReplicaConn // nil: other calls are not expected

	mu     sync.Mutex
	pieces []replica.Extent
}

func (z *zeroConn) Grow(ctx context.Context, o replica.Op, size uint64) error { return nil }
func (z *zeroConn) Flush(ctx context.Context, o replica.Op) error             { return nil }
func (z *zeroConn) Close(ctx context.Context) error                           { return nil }
func (z *zeroConn) DirtyRegions(ctx context.Context, o replica.Op) ([]replica.Extent, error) {
	return nil, nil
}
func (z *zeroConn) WriteZeroes(ctx context.Context, o replica.Op, off, n int64) error {
	if n > replica.MaxZeroes {
		return fmt.Errorf("%w: %d bytes", replica.ErrInvalid, n)
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	z.pieces = append(z.pieces, replica.Extent{Off: off, Len: n})
	return nil
}
func (z *zeroConn) Trim(ctx context.Context, o replica.Op, off, n int64) error {
	return z.WriteZeroes(ctx, o, off, n)
}

// TestLongZeroesAreSplitToTheReplicaCap: an NBD client may trim or zero up
// to 4 GiB in one request; the engine sends the replicas pieces of at most
// replica.MaxZeroes, covering the range exactly, so a legal request works.
func TestLongZeroesAreSplitToTheReplicaCap(t *testing.T) {
	f := newFixture(t)
	const size = 8 << 30
	if _, err := f.client.Volumes.CreateVolume(ctx10(t), &storpb.CreateVolumeRequest{Name: "big", SizeBytes: size, ReplicaCount: 3}); err != nil {
		t.Fatal(err)
	}
	conns := map[string]*zeroConn{}
	var mu sync.Mutex
	cfg := f.config("n1")
	cfg.Volume = "big"
	cfg.Connect = func(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
		mu.Lock()
		defer mu.Unlock()
		z := &zeroConn{}
		conns[open.Replica] = z
		return z, nil
	}
	e := f.open(cfg)
	const nbdMax = 1<<32 - replica.SectorSize // the longest NBD request
	if err := e.Trim(ctx10(t), replica.SectorSize, nbdMax); err != nil {
		t.Fatalf("trim of %d bytes: %v", int64(nbdMax), err)
	}
	if err := e.WriteZeroes(ctx10(t), size-nbdMax, nbdMax, false); err != nil {
		t.Fatalf("zeroes of %d bytes: %v", int64(nbdMax), err)
	}
	want := []replica.Extent{{Off: replica.SectorSize, Len: nbdMax}, {Off: size - nbdMax, Len: nbdMax}}
	mu.Lock()
	defer mu.Unlock()
	if len(conns) != 3 {
		t.Fatalf("%d replicas opened", len(conns))
	}
	for id, z := range conns {
		z.mu.Lock()
		var got []replica.Extent
		for _, p := range z.pieces {
			if p.Len > replica.MaxZeroes {
				t.Fatalf("replica %s was sent %d bytes in one request", id, p.Len)
			}
			if n := len(got); n > 0 && got[n-1].Off+got[n-1].Len == p.Off { // the two ranges are 512 bytes apart
				got[n-1].Len += p.Len
				continue
			}
			got = append(got, p)
		}
		z.mu.Unlock()
		if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
			t.Fatalf("replica %s was sent %v, want pieces covering %v", id, got, want)
		}
	}
	if v := f.volume(); v.Generation != 1 {
		t.Fatalf("generation %d: a replica was marked faulty", v.Generation)
	}
}
