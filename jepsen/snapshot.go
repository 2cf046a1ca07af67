package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// The snapshot workload: while the workers write, one goroutine asks the
// control plane for a snapshot of the volume every few seconds and waits
// until it is ready, and now and then deletes an earlier one (its layer
// is then merged into its neighbour on every replica, under load). A
// snapshot's window runs from the CreateSnapshot call to the first
// GetSnapshot that saw it ready: the engine cut it somewhere in between.
// After the full restart every snapshot still listed is read back from
// every replica that cut it (snapshotReads), and checkSnapshots decides
// whether those contents are the register state at one point of the
// window.
//
// One ready snapshot in three is also cloned into a new volume at once
// (CreateVolume with the snapshot as content source, as a PVC restored
// from a VolumeSnapshot is), so the servers fill clones under load and
// under faults. After the restart every clone is waited for and read back
// from each of its replicas; its contents must be its snapshot's.

// snapOp is one snapshot the workload asked for.
type snapOp struct {
	name, id string
	call     int64
	ready    int64  // when it was first seen ready; 0 while not yet
	size     uint64 // its size, once ready
	err      string
	deleted  bool // a delete of it succeeded
}

// cloneOp is a clone of a snapshot the workload asked for.
type cloneOp struct {
	name string
	snap *snapOp
	call int64
	err  string
}

// snapshotter creates a snapshot every 2-5 s until ctx ends, or, one
// time in three when at least three are ready, deletes one of those
// instead; each create waits up to 30 s for the snapshot to be ready.
func (r *runner) snapshotter(ctx context.Context, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x736e6170))
	for n := 1; ; {
		sleep(ctx, time.Duration(2000+rng.IntN(3000))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		if rng.IntN(3) == 0 {
			if s := r.pickSnapshot(rng, 3); s != nil {
				r.deleteSnapshot(ctx, s)
				continue
			}
		}
		if s := r.snapshot(ctx, fmt.Sprintf("jepsen-%d", n), 0); s != nil && rng.IntN(3) == 0 && !r.cfg.NoClones {
			r.clone(ctx, s, fmt.Sprintf("jepsen-clone-%d", n))
		}
		n++
	}
}

// pickSnapshot returns a random snapshot that was seen ready and not
// deleted, if there are at least atLeast of them.
func (r *runner) pickSnapshot(rng *rand.Rand, atLeast int) *snapOp {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ready []*snapOp
	for _, s := range r.snaps {
		if s.ready != 0 && !s.deleted {
			ready = append(ready, s)
		}
	}
	if len(ready) < atLeast {
		return nil
	}
	return ready[rng.IntN(len(ready))]
}

// snapshot asks for snapshot name and waits until it is ready, failed,
// or 30 s passed (a snapshot still pending then is resolved at the end).
// It returns the snapshot if it was seen ready. Its window starts at
// from, or at the request if from is 0.
func (r *runner) snapshot(ctx context.Context, name string, from int64) *snapOp {
	s := &snapOp{name: name, call: r.now()}
	if from != 0 {
		s.call = from
	}
	r.mu.Lock()
	r.snaps = append(r.snaps, s)
	r.mu.Unlock()
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	resp, err := r.c.Control.Snapshots.CreateSnapshot(cctx, &storpb.CreateSnapshotRequest{VolumeId: r.volumeID, Name: name})
	if err != nil {
		r.setSnap(s, func() { s.err = err.Error() })
		return nil
	}
	id := resp.Snapshot.Id
	r.setSnap(s, func() { s.id = id })
	for cctx.Err() == nil {
		g, err := r.c.Control.Snapshots.GetSnapshot(cctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
		now := r.now()
		switch {
		case err != nil:
		case g.Snapshot.ReadyToUse:
			r.setSnap(s, func() { s.ready, s.size = now, g.Snapshot.SizeBytes })
			return s
		case g.Snapshot.Failed:
			r.setSnap(s, func() { s.err = "failed: " + g.Snapshot.StatusMessage })
			return nil
		}
		sleep(cctx, 50*time.Millisecond)
	}
	return nil
}

// clone asks for a 3-replica clone of snapshot s without waiting for its
// copy: the servers fill it while the run goes on.
func (r *runner) clone(ctx context.Context, s *snapOp, name string) {
	c := &cloneOp{name: name, snap: s, call: r.now()}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	_, err := r.c.Control.Volumes.CreateVolume(cctx, &storpb.CreateVolumeRequest{
		Name: name, SizeBytes: s.size, ReplicaCount: 3,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: s.id}}})
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		c.err = err.Error()
	}
	r.clones = append(r.clones, c)
}

func (r *runner) setSnap(s *snapOp, f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f()
}

// deleteSnapshot deletes s under load and records the attempt.
func (r *runner) deleteSnapshot(ctx context.Context, s *snapOp) {
	o := Op{Client: -1, Kind: "snapshot-delete", Snapshot: s.name, Call: r.now()}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	_, err := r.c.Control.Snapshots.DeleteSnapshot(cctx, &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: s.id}})
	cancel()
	o.Return, o.OK = r.now(), err == nil
	if err != nil {
		o.Err = err.Error()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s.deleted = err == nil // not to be picked again; the final listing decides what is checked
	r.history = append(r.history, o)
}

// readSnapshots runs after the full restart: it records every snapshot
// the workload asked for (Kind "snapshot"; Return is when it was seen
// ready, OK whether it was), resolving those still pending by listing
// them now, and reads every block of every listed ready snapshot from
// every replica still listed CUT (Kind "snapshot-read", one op per replica
// and block, carrying the snapshot's window as Call and Return). A
// snapshot seen ready but listed not ready now is recorded as a
// "snapshot-lost" op, OK when the listing records the loss (lossRecorded).
func (r *runner) readSnapshots(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	listed := map[string]*storpb.Snapshot{}
	for token := ""; ; {
		resp, err := r.c.Control.Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{VolumeId: r.volumeID, PageToken: token})
		if err != nil {
			return fmt.Errorf("listing snapshots: %w", err)
		}
		for _, s := range resp.Snapshots {
			listed[s.Name] = s
		}
		if token = resp.NextPageToken; token == "" {
			break
		}
	}
	at := r.now()
	vol, err := r.c.Control.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: r.volumeID}})
	if err != nil {
		return err
	}
	servers, err := r.c.Control.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		return err
	}
	dataAddr := map[string]string{}
	for _, s := range servers.Servers {
		dataAddr[s.Id] = s.DataAddress
	}

	r.mu.Lock()
	snaps := append([]*snapOp(nil), r.snaps...)
	r.mu.Unlock()
	for _, s := range snaps {
		o := Op{Client: -1, Kind: "snapshot", Snapshot: s.name, Call: s.call, Return: s.ready, OK: s.ready != 0, Err: s.err}
		ls := listed[s.name]
		if ls != nil && ls.ReadyToUse && s.ready == 0 && s.err == "" {
			// Ready since the workload stopped waiting: it was cut by now.
			o.Return, o.OK = at, true
		}
		if !o.OK && o.Err == "" {
			o.Return, o.Err = at, "not ready at the end"
			if ls != nil {
				o.Err += ": " + ls.StatusMessage
			}
		}
		r.record(o)
		if o.OK && ls != nil && !ls.ReadyToUse {
			// Seen ready, listed not ready now: its copies went with
			// replicas that left the volume. Recorded if the listing says
			// so (checkSnapshotLosses decides).
			r.record(lostOp(s.name, o.Return, at, ls))
		}
		if !o.OK || ls == nil || !ls.ReadyToUse {
			continue // never ready, deleted, or lost
		}
		blocks := int(ls.SizeBytes / blockStride)
		layer := replica.LayerName(ls.Id, ls.CutEpoch)
		for _, rep := range ls.Replicas {
			if rep.State != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
				continue
			}
			data, err := readBlocks(ctx, r.c.Dial, dataAddr[rep.ServerId], vol.Volume.Id, rep.ReplicaId, layer, vol.Volume.Epoch, blocks)
			r.recordBlocks(Op{Snapshot: s.name, Replica: rep.ReplicaId, Call: o.Call, Return: o.Return}, data, err, blocks)
		}
	}
	return r.readClones(ctx, dataAddr)
}

// lostOp is the "snapshot-lost" op of snapshot name, seen ready at seen
// and listed not ready (ls) at at: OK when the listing records the loss.
func lostOp(name string, seen, at int64, ls *storpb.Snapshot) Op {
	return Op{Client: -1, Kind: "snapshot-lost", Snapshot: name, Call: seen, Return: at, OK: lossRecorded(ls), Err: ls.StatusMessage}
}

// lossRecorded reports whether listed snapshot s, not ready, says why:
// failed, with no CUT copy and at least one copy recorded LOST.
func lossRecorded(s *storpb.Snapshot) bool {
	lost := false
	for _, rep := range s.Replicas {
		switch rep.State {
		case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT:
			return false
		case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST:
			lost = lost || rep.Reason != ""
		}
	}
	return s.Failed && lost
}

// readClones waits for every clone the workload asked for to be filled
// (up to 90 s in all) and reads every block of its snapshot's registers
// from each of its replicas, as "snapshot-read" ops of its snapshot (its
// window) that name the clone.
func (r *runner) readClones(ctx context.Context, dataAddr map[string]string) error {
	r.mu.Lock()
	clones := append([]*cloneOp(nil), r.clones...)
	r.mu.Unlock()
	deadline := time.Now().Add(90 * time.Second)
	for _, c := range clones {
		o := Op{Client: -1, Kind: "clone", Snapshot: c.snap.name, Clone: c.name, Call: c.call, Err: c.err}
		var v *storpb.Volume
		for c.err == "" {
			resp, err := r.c.Control.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: c.name}})
			if err == nil && resp.Volume.State == storpb.VolumeState_VOLUME_STATE_AVAILABLE {
				v = resp.Volume
				break
			}
			if time.Now().After(deadline) {
				o.Err = fmt.Sprintf("not filled 90 s after the restart (%v)", err)
				if err == nil {
					o.Err = fmt.Sprintf("not filled 90 s after the restart: %v", resp.Volume.State)
				}
				break
			}
			sleep(ctx, 200*time.Millisecond)
		}
		o.Return, o.OK = r.now(), v != nil
		r.record(o)
		if v == nil {
			continue
		}
		blocks := int(c.snap.size / blockStride)
		for _, rep := range v.Replicas {
			data, err := readBlocks(ctx, r.c.Dial, dataAddr[rep.ServerId], v.Id, rep.Id, "", v.Epoch, blocks)
			r.recordBlocks(Op{Snapshot: c.snap.name, Clone: c.name, Replica: rep.Id, Call: c.snap.call, Return: c.snap.ready}, data, err, blocks)
		}
	}
	return nil
}

// recordBlocks records what readBlocks returned as one op per block, each
// otherwise like base (Kind "snapshot-read" unless base names one).
func (r *runner) recordBlocks(base Op, data [][]byte, err error, blocks int) {
	base.Client = -1
	if base.Kind == "" {
		base.Kind = "snapshot-read"
	}
	for b := range blocks {
		o := base
		o.Block = b
		if err != nil {
			o.Err = err.Error()
		} else {
			o.OK = true
			o.decode(data[b], r.cfg.Seed)
		}
		r.record(o)
	}
}

// readBlocks reads the first block of every register from one replica of
// volume volumeID, of snapshot layer layer, or of its head when layer is
// "", opened for inspection at the volume's current epoch, over dial (an
// operator's certificate: only an operator may inspect a replica).
func readBlocks(ctx context.Context, dial pki.DialFunc, addr, volumeID, replicaID, layer string, epoch uint64, blocks int) ([][]byte, error) {
	if addr == "" {
		return nil, errors.New("the replica's server has no data address")
	}
	conn, err := wire.Dial(ctx, "tcp", addr, wire.ClientConfig{Dial: dial})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	h, err := conn.OpenFor(ctx, wire.OpenRequest{Replica: replicaID, Volume: volumeID, Epoch: epoch, Purpose: wire.PurposeInspect})
	if err != nil {
		return nil, err
	}
	defer h.Close(ctx)
	out := make([][]byte, blocks)
	for b := range blocks {
		out[b] = make([]byte, BlockSize)
		var err error
		if layer == "" {
			err = h.ReadAt(ctx, replica.Op{Epoch: epoch}, out[b], int64(b)*blockStride)
		} else {
			err = h.ReadSnapshotAt(ctx, replica.Op{Epoch: epoch}, layer, out[b], int64(b)*blockStride)
		}
		if err != nil {
			return nil, fmt.Errorf("read %q of replica %s at block %d: %w", layer, replicaID, b, err)
		}
	}
	return out, nil
}
