package server_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// dataAttacker reaches the data ports with nothing but the network (no
// identity): it knows the volume's replicas and their servers' data
// addresses, as anyone who can list them can.
type dataAttacker struct {
	t    *testing.T
	c    *servertest.Cluster
	addr map[string]string // replica id -> data address
	// dial, if set, is the attacker's dialer (a TLS cluster: with some
	// certificate); nil dials plaintext.
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

func newDataAttacker(t *testing.T, c *servertest.Cluster, leader int, v *storpb.Volume) *dataAttacker {
	servers := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	a := &dataAttacker{t: t, c: c, addr: map[string]string{}}
	for _, r := range v.Replicas {
		for _, s := range servers.Servers {
			if s.Id == r.ServerId {
				a.addr[r.Id] = s.DataAddress
			}
		}
	}
	return a
}

// open tries an OPEN; the connection is closed at the end of the test.
func (a *dataAttacker) open(ctx context.Context, r wire.OpenRequest) (*wire.Handle, error) {
	a.t.Helper()
	conn, err := wire.Dial(ctx, "tcp", a.addr[r.Replica], wire.ClientConfig{Dial: a.dial})
	if err != nil {
		return nil, err
	}
	a.t.Cleanup(func() { conn.Close() })
	return conn.OpenFor(ctx, r)
}

// TestDataPortAttacks is issue 15's data-port attacks, each made by a peer
// with nothing but network access, against a volume attached to node-1
// with its engine writing: fencing it forever with epoch 2^64-1, opening
// it at the current epoch from a node it is not attached to (to read, to
// write, to zero it), growing it to 1 PiB, deleting a snapshot layer the
// metadata calls ready. Each is refused, and the volume's engine, its
// replicas' bytes and its snapshot are as they were.
func TestDataPortAttacks(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.InsecureDataInspect = false // as deployed
	}})
	leader := c.Leader(10 * time.Second)
	const size = 16 << 20
	v := createVolume(t, c.Client(leader), "target", size, 3)
	ctx := ctxT(t, 2*time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	data := bytes.Repeat([]byte("precious"), size/8)
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	snapData := bytes.Clone(data)
	s := createSnapshot(t, c, leader, v.Id, "ready")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot cut by the engine", func(s *storpb.Snapshot) bool { return s.ReadyToUse })
	layer := replica.LayerName(s.Id, s.CutEpoch)
	v = getVolume(t, c, leader, v.Id)
	a := newDataAttacker(t, c, leader, v)
	epoch := e.Epoch()

	type attack struct {
		name string
		open wire.OpenRequest
	}
	openAs := func(r *storpb.Replica, node string, ep uint64, p wire.Purpose) wire.OpenRequest {
		return wire.OpenRequest{Replica: r.Id, Volume: v.Id, Node: node, Epoch: ep, Purpose: p}
	}
	// refused tries each open; one granted is used as its opener would
	// (read the data, zero it, write over it) and reported.
	refused := func(r *storpb.Replica, attacks []attack) {
		for _, tc := range attacks {
			h, err := a.open(ctx, tc.open)
			if err == nil {
				buf := make([]byte, 4096)
				rerr := h.ReadAt(ctx, replica.Op{Epoch: epoch}, buf, 0)
				zerr := h.WriteZeroes(ctx, replica.Op{Epoch: epoch, Generation: v.Generation}, 0, size)
				werr := h.WriteAt(ctx, replica.Op{Epoch: epoch, Generation: v.Generation}, bytes.Repeat([]byte("attacker"), 512), 0)
				t.Errorf("replica %s: open %s granted (then read: %v, zeroes: %v, write: %v)", r.Id, tc.name, rerr, zerr, werr)
				continue
			}
			if !errors.Is(err, wire.ErrDenied) && !errors.Is(err, replica.ErrStaleEpoch) {
				t.Errorf("replica %s: open %s: %v, want a refusal", r.Id, tc.name, err)
			}
		}
	}

	// At the current epoch, by openers the volume is not attached to, or
	// for a purpose the metadata does not call for.
	for _, r := range v.Replicas {
		refused(r, []attack{
			{"the current epoch from another node", openAs(r, "node-evil", epoch, wire.PurposeAttach)},
			{"the current epoch stating nothing", wire.OpenRequest{Replica: r.Id, Epoch: epoch}},
			{"epoch 0 stating nothing (the old unfenced open)", wire.OpenRequest{Replica: r.Id}},
			{"a rebuild of an attached volume", openAs(r, r.ServerId, epoch, wire.PurposeRebuild)},
			{"a snapshot cut of an attached volume", openAs(r, r.ServerId, epoch, wire.PurposeSnapshotCut)},
			{"an unverified inspection", openAs(r, "", epoch, wire.PurposeInspect)},
			{"a clone copy no clone calls for", wire.OpenRequest{Replica: r.Id, Volume: v.Id, Node: r.ServerId, Snapshot: s.Id, Epoch: epoch, Purpose: wire.PurposeCloneCopy}},
		})
	}

	// Without TLS, naming the attached node at the committed epoch cannot
	// be refused (dataauth.go); what that handle may do is still bounded
	// by the metadata.
	for _, r := range v.Replicas {
		h, err := a.open(ctx, openAs(r, "node-1", epoch, wire.PurposeAttach))
		if err != nil {
			t.Errorf("replica %s: open as the attachment: %v", r.Id, err)
			continue
		}
		o := replica.Op{Epoch: epoch, Generation: v.Generation}
		if err := h.Grow(ctx, o, 1<<50); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: GROW 16 MiB -> 1 PiB: %v, want ErrDenied", r.Id, err)
		}
		if err := h.DeleteSnapshot(ctx, o, layer); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: SNAPSHOT_DELETE of ready layer %s: %v, want ErrDenied", r.Id, layer, err)
		}
		if err := h.CreateSnapshot(ctx, o, replica.LayerName("snap-evil", epoch)); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: SNAPSHOT_CREATE of a snapshot nobody asked for: %v, want ErrDenied", r.Id, err)
		}
		if err := h.ReadSnapshotAt(ctx, o, replica.LayerName("snap-evil", epoch), make([]byte, 4096), 0); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: SNAPSHOT_READ of an unlisted layer: %v, want ErrDenied", r.Id, err)
		}
		if err := h.WriteAt(ctx, replica.Op{Epoch: epoch, Generation: 1<<64 - 1}, make([]byte, 4096), 0); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: WRITE at generation 2^64-1: %v, want ErrDenied", r.Id, err)
		}
		fence := replica.Op{Epoch: 1<<64 - 1, Generation: v.Generation}
		if err := h.WriteZeroes(ctx, fence, 0, 4096); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: WRITE_ZEROES at epoch 2^64-1: %v, want ErrDenied", r.Id, err)
		}
		if err := h.Flush(ctx, fence); !errors.Is(err, wire.ErrDenied) {
			t.Errorf("replica %s: FLUSH at epoch 2^64-1: %v, want ErrDenied", r.Id, err)
		}
	}

	// Above the committed epoch, which would fence the volume for good.
	for _, r := range v.Replicas {
		refused(r, []attack{
			{"the next epoch as the attached node", openAs(r, "node-1", epoch+1, wire.PurposeAttach)},
			{"epoch 2^64-1 as a server's rebuild", openAs(r, r.ServerId, 1<<64-1, wire.PurposeRebuild)},
			{"epoch 2^64-1 stating nothing", wire.OpenRequest{Replica: r.Id, Epoch: 1<<64 - 1}},
			{"epoch 2^64-1 as the attached node", openAs(r, "node-1", 1<<64-1, wire.PurposeAttach)},
			// An incarnation no engine can have yet, which would make
			// every later one of the engine's older (wire's doc,
			// "Incarnations").
			{"incarnation 2^64-1 as the attached node", wire.OpenRequest{Replica: r.Id, Volume: v.Id, Node: "node-1", Epoch: epoch,
				Purpose: wire.PurposeAttach, Incarnation: 1<<64 - 1}},
		})
		h, err := a.open(ctx, openAs(r, "node-1", epoch, wire.PurposeAttach))
		if err != nil {
			t.Errorf("replica %s after the attacks: %v", r.Id, err)
		} else if h.Size() != size || h.Epoch() != epoch {
			t.Errorf("replica %s after the attacks: size %d epoch %d, want %d and %d", r.Id, h.Size(), h.Epoch(), size, epoch)
		}
	}

	// The volume is still its engine's: it writes, reads back, and every
	// replica holds the same bytes; the snapshot still reads.
	copy(data[4096:], bytes.Repeat([]byte("engine"), 100))
	if err := e.WriteAt(ctx, data[4096:8192], 4096, true); err != nil {
		t.Fatalf("the engine after the attacks: %v", err)
	}
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the engine reads back other bytes after the attacks (%v)", err)
	}
	// Every replica holds the same bytes, and its snapshot layer the
	// snapshot's (read as the attachment, which the metadata allows).
	for _, r := range v.Replicas {
		h, err := a.open(ctx, openAs(r, "node-1", epoch, wire.PurposeAttach))
		if err != nil {
			t.Fatalf("replica %s: %v", r.Id, err)
		}
		head, layerData := make([]byte, size), make([]byte, size)
		for off := 0; off < size; off += replica.MaxIO {
			o := replica.Op{Epoch: epoch}
			if err := h.ReadAt(ctx, o, head[off:off+replica.MaxIO], int64(off)); err != nil {
				t.Fatalf("read replica %s: %v", r.Id, err)
			}
			if err := h.ReadSnapshotAt(ctx, o, layer, layerData[off:off+replica.MaxIO], int64(off)); err != nil {
				t.Fatalf("read snapshot layer %s of %s: %v", layer, r.Id, err)
			}
		}
		if !bytes.Equal(head, data) {
			t.Errorf("replica %s holds other bytes than its engine wrote", r.Id)
		}
		if !bytes.Equal(layerData, snapData) {
			t.Errorf("snapshot layer %s of replica %s holds other bytes than the snapshot", layer, r.Id)
		}
	}
}

// TestDataPortTakeoverStillWorks: the legitimate way to a higher epoch —
// an attach with takeover through the control plane — opens every
// replica, and fences the old engine.
func TestDataPortTakeoverStillWorks(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "moving", 1<<20, 3)
	ctx := ctxT(t, time.Minute)
	old := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := old.WriteAt(ctx, blockData(0, 1), 0, true); err != nil {
		t.Fatal(err)
	}
	cfg := c.EngineConfig(v.Name, "node-2")
	cfg.Takeover = true
	e := c.OpenEngine(cfg)
	if e.Epoch() <= old.Epoch() {
		t.Fatalf("takeover epoch %d, old %d", e.Epoch(), old.Epoch())
	}
	if err := e.WriteAt(ctx, blockData(0, 2), 0, true); err != nil {
		t.Fatalf("write after the takeover: %v", err)
	}
	if err := old.WriteAt(ctx, blockData(0, 3), 0, true); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("the old engine's write after the takeover: %v, want ErrFenced", err)
	}
	for _, r := range getVolume(t, c, leader, v.Id).Replicas {
		if r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			t.Fatalf("replica %s is %v after the takeover: an open was refused", r.Id, r.State)
		}
	}
	got := make([]byte, snapBlock)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, blockData(0, 2)) {
		t.Fatalf("read after the takeover: %v", err)
	}
}

// TestDataPortFollowerAppliesAttachLate: an engine opens its replicas as
// soon as the leader has applied its attach; a server cut off from the
// leader applies it late. Its OPEN at the new epoch waits for it (bounded),
// and is granted once the server has caught up — never on the stale view,
// never refused for good while the wait lasts. A server that cannot catch
// up within the wait refuses, and the refusal fences nothing.
func TestDataPortFollowerAppliesAttachLate(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "late", 1<<20, 3)
	attach := func(node string) *storpb.Volume {
		return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return c.Client(leader).Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: node, Takeover: true})
		}).Volume
	}
	v = attach("node-1")
	f := (leader + 1) % 3
	var rep *storpb.Replica
	for _, r := range v.Replicas {
		if r.ServerId == c.Nodes[f].ID {
			rep = r
		}
	}
	if rep == nil {
		t.Fatalf("no replica on server %s: %v", c.Nodes[f].ID, v)
	}
	a := newDataAttacker(t, c, leader, v)
	ctx := ctxT(t, time.Minute)
	openAt := func(node string, epoch uint64) (*wire.Handle, error) {
		return a.open(ctx, wire.OpenRequest{Replica: rep.Id, Volume: v.Id, Node: node, Epoch: epoch, Purpose: wire.PurposeAttach})
	}

	// Cut off, the follower misses the takeover; the cut heals a second
	// into the open.
	c.Partition(f)
	moved := attach("node-2")
	healed := make(chan time.Time, 1)
	go func() {
		time.Sleep(time.Second)
		c.Heal()
		healed <- time.Now()
	}()
	h, err := openAt("node-2", moved.Epoch)
	granted := time.Now()
	if err != nil {
		t.Fatalf("open at the takeover's epoch %d on a follower that applies it late: %v", moved.Epoch, err)
	}
	if at := <-healed; granted.Before(at) {
		t.Fatalf("granted at %v, before the follower could apply the takeover (healed at %v)", granted, at)
	}
	if h.Epoch() != moved.Epoch {
		t.Fatalf("handle at epoch %d, want %d", h.Epoch(), moved.Epoch)
	}

	// Cut off for longer than the wait: refused, and nothing fenced.
	c.Partition(f)
	moved = attach("node-3")
	start := time.Now()
	if _, err := openAt("node-3", moved.Epoch); !errors.Is(err, wire.ErrDenied) {
		t.Fatalf("open at an epoch the cut-off follower has not applied: %v, want ErrDenied", err)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("the refusal took %v: the wait is not bounded", d)
	}
	c.Heal()
	h, err = openAt("node-3", moved.Epoch)
	if err != nil {
		t.Fatalf("open at epoch %d after the follower caught up: %v", moved.Epoch, err)
	}
	if h.Epoch() != moved.Epoch {
		t.Fatalf("handle at epoch %d, want %d: the refused open fenced the replica", h.Epoch(), moved.Epoch)
	}
}
