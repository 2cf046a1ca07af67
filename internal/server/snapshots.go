package server

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// The data plane's share of snapshots and clones, run by every reconcile
// for this server's replicas (see raftstore/snapshot.go for the records):
//
//   - cut: the snapshots pending on a detached volume are cut by one
//     server, the one with the volume's first healthy replica (by id)
//     whose server is up: engine.CutDetached fences the volume at a new
//     epoch, opens and reconciles its replicas, cuts each at that one
//     point and records the cuts (a replica it could not open or cut is
//     recorded as missed). Servers that see it otherwise (a lagging view)
//     only cost a retry: each cut fences at its own epoch. An attached
//     volume's engine cuts its replicas itself, with writes held.
//   - copy: a local replica of a clone (CREATING) whose source snapshot is
//     ready is filled from a replica that holds the snapshot's layer,
//     pulled over the replica data protocol (extents, then snapshot reads;
//     all-zero chunks become WRITE_ZEROES so the copy stays sparse),
//     flushed, and recorded with RecordCloneCopied.
//   - merge: a local snapshot layer (named replica.LayerName(snapshot, cut
//     epoch)) whose record is gone (deleted), whose record says this
//     replica missed it or lost it (LOST: the replica left the volume),
//     or that was cut at another epoch than the snapshot's recorded cuts,
//     is deleted, which merges it into the layer above. A layer whose record this server cannot find is merged only
//     once this server has caught up with the leader.
//
// Each task runs in its own goroutine, at most one per key; a failed task
// is retried by a later reconcile, after a wait that doubles with each
// failure in a row (runTask).

// reconcileSnapshots starts the snapshot tasks desired's replicas need
// in view w: detached cuts, clone copies, merges of stray layers.
func (d *dataPlane) reconcileSnapshots(desired map[string]placed, w *clusterView) {
	type layerRef struct{ replica, layer, snapshot string }
	var unknown []layerRef      // local layers with no record in our view
	wanted := map[string]bool{} // the tasks this reconcile asks for
	defer d.forgetTasksGone(wanted)
	run := func(key string, fn func() error) {
		wanted[key] = true
		d.runTask(key, fn)
	}
	for id, p := range desired {
		v, rep := p.vol, p.rep
		if v.Attachment == nil && len(v.PendingSnapshotIds) > 0 && detachedCutter(v, w.servers) == id {
			run("cut/"+v.Id, func() error { return d.cutDetached(v) })
		}
		if v.State == storpb.VolumeState_VOLUME_STATE_CREATING && !slices.Contains(v.CloneDoneReplicaIds, id) {
			if s := w.snaps[v.CloneSnapshotId]; s != nil && s.ReadyToUse {
				run("clone/"+id, func() error { return d.copyClone(v, rep, s, w) })
			}
		}
		r, err := d.store.Get(id)
		if err != nil {
			continue
		}
		for _, layer := range r.Snapshots() {
			sid, epoch, ok := replica.ParseLayerName(layer)
			if !ok {
				continue // not a layer the cluster named
			}
			s := w.snaps[sid]
			if s == nil {
				unknown = append(unknown, layerRef{id, layer, sid})
				wanted["merge/"+id+"/"+layer] = true // perhaps: see below
				continue
			}
			if why := strayLayer(s, v, id, epoch); why != "" {
				run("merge/"+id+"/"+layer, func() error { return d.mergeLayer(r, layer, why) })
			}
		}
	}
	if len(unknown) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(d.s.ctx, 5*time.Second)
	defer cancel()
	if err := d.catchUp(ctx); err != nil {
		return // not sure our view is current: keep the layers for now
	}
	for _, l := range unknown {
		rid, sid, layer := l.replica, l.snapshot, l.layer
		err := d.s.store.View(func(rd *raftstore.Reader) error {
			_, err := rd.Snapshot(sid)
			return err
		})
		if !errors.Is(err, raftstore.ErrNotFound) {
			continue
		}
		r, err := d.store.Get(rid)
		if err != nil {
			continue
		}
		run("merge/"+rid+"/"+layer, func() error { return d.mergeLayer(r, layer, "the snapshot was deleted") })
	}
}

// strayLayer says why local layer (snapshot s cut at epoch) of replica id
// of volume v is not the snapshot's and must be merged, or "" to keep it:
// the replica missed the snapshot or is not in it; the snapshot's cuts are
// at another epoch; or the replica is still pending but the layer was cut
// at an epoch the volume has left (that cut can no longer be recorded).
func strayLayer(s *storpb.Snapshot, v *storpb.Volume, id string, epoch uint64) string {
	switch snapshotEntry(s, id) {
	case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT:
		if epoch != s.CutEpoch {
			return fmt.Sprintf("cut at epoch %d, the snapshot's cuts are at epoch %d", epoch, s.CutEpoch)
		}
	case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING:
		if epoch < v.Epoch {
			return fmt.Sprintf("cut at epoch %d, never recorded; the volume is at epoch %d", epoch, v.Epoch)
		}
	case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST:
		return "this replica's copy is recorded lost"
	default:
		return "this replica missed the snapshot"
	}
	return ""
}

// snapshotEntry is replica id's state in s (UNSPECIFIED: not listed).
func snapshotEntry(s *storpb.Snapshot, id string) storpb.SnapshotReplicaState {
	for _, r := range s.Replicas {
		if r.ReplicaId == id {
			return r.State
		}
	}
	return storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_UNSPECIFIED
}

// runTask runs fn in a goroutine unless a task with the same key is
// running. A failure is logged; a later reconcile retries, after a wait
// that doubles with each failure in a row (taskRetryWait up to
// taskRetryMaxWait) and starts over after a success. A task that keeps
// failing (a detached cut whose reconcile cannot read a source, say)
// would otherwise run every second for as long as the cause lasts, and a
// detached cut raises its volume's epoch, a Raft entry, at each attempt.
func (d *dataPlane) runTask(key string, fn func() error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.tasks[key] || d.s.ctx.Err() != nil {
		return
	}
	d.tasks[key] = true
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		err := fn()
		d.mu.Lock()
		if d.taskFailures == nil {
			d.taskFailures = map[string]int{}
		}
		failures := 0
		if err != nil {
			d.taskFailures[key]++
			failures = d.taskFailures[key]
		} else {
			delete(d.taskFailures, key)
		}
		d.mu.Unlock()
		if err != nil && d.s.ctx.Err() == nil {
			wait := taskRetryDelay(failures)
			d.s.logger.Warn("snapshot task failed; will retry", "task", key, "failures", failures, "retry_in", wait, "err", err)
			select { // back off before the next attempt
			case <-d.s.ctx.Done():
			case <-time.After(wait):
			}
		}
		d.mu.Lock()
		delete(d.tasks, key)
		d.mu.Unlock()
	}()
}

// A failed snapshot task is retried after taskRetryWait, the wait
// doubling with each failure in a row up to taskRetryMaxWait.
var (
	taskRetryWait    = time.Second
	taskRetryMaxWait = 30 * time.Second
)

// taskRetryDelay is the wait before the next attempt of a task that has
// failed failures times in a row (at least once).
func taskRetryDelay(failures int) time.Duration {
	wait := taskRetryWait
	for i := 1; i < failures && wait < taskRetryMaxWait; i++ {
		wait *= 2
	}
	return min(wait, taskRetryMaxWait)
}

// forgetTasksGone drops the failure counts of the tasks that a reconcile
// no longer asks for (wanted: the keys it started or found running), so
// that the counts of finished or abandoned tasks do not pile up.
func (d *dataPlane) forgetTasksGone(wanted map[string]bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for key := range d.taskFailures {
		if !wanted[key] && !d.tasks[key] {
			delete(d.taskFailures, key)
		}
	}
}

// detachedCutter is the replica whose server cuts detached volume v's
// pending snapshots: the first healthy one (by id) whose server is up; ""
// if none.
func detachedCutter(v *storpb.Volume, servers map[string]*storpb.Server) string {
	var ids []string
	for _, r := range v.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && !r.ServerRemoved &&
			servers[r.ServerId].GetState() == storpb.ServerState_SERVER_STATE_UP {
			ids = append(ids, r.Id)
		}
	}
	if len(ids) == 0 {
		return ""
	}
	return slices.Min(ids)
}

// cutDetached cuts the pending snapshots of detached volume v (see the
// file comment). An attach that got in first makes it a no-op: the
// attached engine cuts them.
func (d *dataPlane) cutDetached(v *storpb.Volume) error {
	ctx, cancel := context.WithTimeout(d.s.ctx, 2*time.Minute)
	defer cancel()
	conn := d.s.selfConn()
	return engine.CutDetached(ctx, engine.Config{
		Volume: v.Id, VolumeIsID: true, NodeID: d.s.cfg.ID, LocalServerID: d.s.cfg.ID,
		Control: engine.ControlPlane{
			Volumes:   storpb.NewVolumeServiceClient(conn),
			Cluster:   storpb.NewClusterServiceClient(conn),
			Snapshots: storpb.NewSnapshotServiceClient(conn),
		},
		Connect: engine.WireConnector(wire.ClientConfig{Dial: d.s.dialData}),
		Logger:  d.s.logger,
	})
}

// mergeLayer deletes snapshot layer sid of r (merging it up).
func (d *dataPlane) mergeLayer(r *replica.Replica, sid, why string) error {
	if err := r.DeleteSnapshot(replica.Op{Epoch: r.Epoch()}, sid); err != nil && !errors.Is(err, replica.ErrNotFound) {
		return fmt.Errorf("merge snapshot layer %s of %s: %w", sid, r.ID(), err)
	}
	d.s.logger.Info("snapshot layer merged", "replica", r.ID(), "snapshot", sid, "why", why)
	return nil
}

// cloneExtents is how many extents one EXTENTS request of a copy asks for.
const cloneExtents = 512

// copyClone fills local replica rep of clone v from snapshot s.
func (d *dataPlane) copyClone(v *storpb.Volume, rep *storpb.Replica, s *storpb.Snapshot, w *clusterView) error {
	ctx := d.s.ctx
	src := w.vols[s.VolumeId]
	if src == nil {
		return fmt.Errorf("source volume %s of snapshot %s not found", s.VolumeId, s.Name)
	}
	// A replica that holds the layer: the local one first.
	var sources []*storpb.Replica
	for _, r := range src.Replicas {
		if raftstore.SnapshotServes(s, r.Id) && !r.ServerRemoved {
			sources = append(sources, r)
		}
	}
	slices.SortStableFunc(sources, func(a, b *storpb.Replica) int {
		return boolInt(b.ServerId == d.s.cfg.ID) - boolInt(a.ServerId == d.s.cfg.ID)
	})
	dst, err := d.store.Get(rep.Id)
	if err != nil {
		return err
	}
	defer dst.Pin()() // the store keeps its files open for the copy
	var errs []error
	for _, from := range sources {
		srv := w.servers[from.ServerId]
		if srv == nil {
			continue
		}
		start := time.Now()
		n, err := d.copyFrom(ctx, srv.DataAddress, from.Id, src, s, dst, replica.Op{Epoch: v.Epoch, Generation: v.Generation})
		if err != nil {
			errs = append(errs, fmt.Errorf("from %s: %w", from.Id, err))
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_, err = storpb.NewVolumeServiceClient(d.s.selfConn()).RecordCloneCopied(cctx, &storpb.RecordCloneCopiedRequest{VolumeId: v.Id, ReplicaId: rep.Id})
		cancel()
		if err != nil {
			return fmt.Errorf("record clone copy: %w", err)
		}
		d.s.logger.Info("clone replica filled", "volume", v.Name, "volume_id", v.Id, "replica", rep.Id, "snapshot", s.Name,
			"source", from.Id, "bytes", n, "took", time.Since(start).Round(time.Millisecond))
		return nil
	}
	if len(errs) == 0 {
		return fmt.Errorf("no replica of %s holds snapshot %s", src.Name, s.Name)
	}
	return errors.Join(errs...)
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// taskCall runs one request of a server task to a replica, bounded by
// TaskIOTimeout: a replica that takes it and never answers fails the
// task's attempt instead of holding it (and its entry in d.tasks, so
// every later attempt) until the server restarts.
func (d *dataPlane) taskCall(ctx context.Context, f func(context.Context) error) error {
	if t := d.s.cfg.TaskIOTimeout; t > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}
	return f(ctx)
}

// copyFrom copies snapshot s from replica srcID of volume src (on the
// server at addr, opened at src's epoch for this clone copy) into dst,
// flushes dst, and returns the bytes copied. A source that fails, or does
// not answer a request within TaskIOTimeout, fails it: copyClone then
// reads the next source. A source volume fenced at a newer epoch meanwhile
// (an attach, a detach, a cut of a snapshot while detached) makes its
// replicas refuse the copy's epoch; the snapshot's layer does not change,
// so the copy opens the source again at the volume's new epoch and goes on
// where it was (before, it started over from the first byte, and a clone
// of a volume snapshotted or attached more often than its copy took
// never finished).
func (d *dataPlane) copyFrom(ctx context.Context, addr, srcID string, src *storpb.Volume, s *storpb.Snapshot, dst *replica.Replica, o replica.Op) (int64, error) {
	c := cloneCopy{d: d, addr: addr, srcID: srcID, src: src.Id, s: s, dst: dst, o: o, buf: make([]byte, replica.MaxIO)}
	epoch := src.Epoch
	for reopened := 0; ; reopened++ {
		err := c.from(ctx, epoch)
		if err == nil {
			break
		}
		if !errors.Is(err, replica.ErrStaleEpoch) || reopened == maxCloneReopens {
			return c.copied, err
		}
		newer, verr := d.volumeEpoch(ctx, src.Id)
		if verr != nil || newer <= epoch {
			return c.copied, err
		}
		d.s.logger.Info("clone copy goes on at the source's new epoch", "replica", srcID, "snapshot", s.Name, "epoch", newer, "at", c.next)
		epoch = newer
	}
	if err := dst.Flush(o); err != nil {
		return c.copied, fmt.Errorf("flush: %w", err)
	}
	return c.copied, nil
}

// maxCloneReopens bounds how often one copy opens its source again at a
// newer epoch before the attempt fails (and a later one starts over).
const maxCloneReopens = 100

// volumeEpoch is volume id's epoch once this server has caught up with
// the leader.
func (d *dataPlane) volumeEpoch(ctx context.Context, id string) (uint64, error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := d.catchUp(cctx); err != nil {
		return 0, err
	}
	var epoch uint64
	err := d.view(func(r *raftstore.Reader) error {
		v, err := r.Volume(id)
		if err == nil {
			epoch = v.Epoch
		}
		return err
	})
	return epoch, err
}

// cloneCopy is one clone copy from one source replica: what it has
// copied, and where it is (every extent of the layer below next is
// copied).
type cloneCopy struct {
	d      *dataPlane
	addr   string
	srcID  string
	src    string // the source volume's id
	s      *storpb.Snapshot
	dst    *replica.Replica
	o      replica.Op
	buf    []byte
	next   int64 // the copy's position
	copied int64
}

// from opens the source at epoch and copies from c.next to the end.
func (c *cloneCopy) from(ctx context.Context, epoch uint64) error {
	d := c.d
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := wire.Dial(dctx, "tcp", c.addr, wire.ClientConfig{Dial: d.s.dialData})
	if err != nil {
		cancel()
		return err
	}
	defer conn.Close()
	h, err := conn.OpenFor(dctx, wire.OpenRequest{
		Replica: c.srcID, Volume: c.src, Node: d.s.cfg.ID, Snapshot: c.s.Id, Epoch: epoch, Purpose: wire.PurposeCloneCopy,
	})
	cancel()
	if err != nil {
		return err
	}
	defer closeWithin(h, closeTimeout)
	so := replica.Op{Epoch: epoch}
	layer := replica.LayerName(c.s.Id, c.s.CutEpoch)
	for {
		var exts []replica.Extent
		err := d.taskCall(ctx, func(ctx context.Context) (err error) {
			exts, err = h.Extents(ctx, so, layer, c.next, cloneExtents)
			return err
		})
		if err != nil {
			return fmt.Errorf("extents: %w", err)
		}
		for _, e := range exts {
			// c.next is where the copy is: an extent below it (a page
			// asked for again after a reopen may begin below) is done.
			for off := max(e.Off, c.next); off < e.Off+e.Len; {
				n := min(int64(len(c.buf)), e.Off+e.Len-off)
				p := c.buf[:n]
				if err := d.taskCall(ctx, func(ctx context.Context) error { return h.ReadSnapshotAt(ctx, so, layer, p, off) }); err != nil {
					return fmt.Errorf("read at %d: %w", off, err)
				}
				if allZero(p) {
					err = c.dst.WriteZeroes(c.o, off, n)
				} else {
					err = c.dst.WriteAt(c.o, p, off)
				}
				if err != nil {
					return fmt.Errorf("write at %d: %w", off, err)
				}
				c.copied += n
				off += n
				c.next = off
			}
		}
		if len(exts) < cloneExtents {
			return nil
		}
		last := exts[len(exts)-1]
		c.next = max(c.next, last.Off+last.Len)
	}
}

func allZero(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}
