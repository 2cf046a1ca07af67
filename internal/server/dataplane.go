package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/localread"
	"github.com/stor-io/stor/replica/wire"
)

// dataPlane is this server's share of the data path: the replica store on
// its disk (DataDir/replicas), the replica data service on DataListen, and
// a loop that keeps the store in line with the metadata:
//
//   - creates the replicas placed here and grows them with their volume;
//   - fences each replica to its volume's committed epoch, so an engine
//     fenced by a newer attach is refused here even if the new engine never
//     reached this replica;
//   - deletes replicas no longer placed here, but only when this server has
//     caught up with the leader (a lagging view must not delete data);
//   - rebuilds this server's rebuilding replicas of detached volumes (an
//     attached volume's engine rebuilds its own, since it also sends the
//     target every new write);
//   - records this server's failed or damaged replicas of detached volumes
//     FAULTY, so that the leader replaces them (reportFailed; an attached
//     volume's engine records the replicas that fail its requests);
//   - cuts snapshots of detached volumes, fills clones' replicas, and
//     merges deleted snapshots' layers (snapshots.go).
//
// The data service authorises each OPEN and each request against the
// applied metadata (dataauth.go); this server's own opens (rebuild, clone
// copy, detached cut) state their purpose so that other servers can.
type dataPlane struct {
	s     *Server
	store *replica.Store
	wire  *wire.Server
	lis   net.Listener
	local *localread.Server // nil without Config.LocalSocket
	// sources reads the sources of the rebuild copies this server's
	// rebuilding replicas are asked to make (copysource.go).
	sources *wire.Sources

	// view reads the cluster's state and catchUp waits until this server
	// has applied what the leader has (the Server's; seams for tests);
	// last is the clusterView the loop read last.
	view    func(func(*raftstore.Reader) error) error
	catchUp func(context.Context) error
	last    *clusterView
	// dataDirID names this server's data dir (raftstore.Store.DataDirID);
	// foreignDir is what the cluster's record of this server said at the
	// last reconcile that did nothing for it (ownsPlacements: "none", or
	// "dir <id>"), so its warning is said once.
	dataDirID, foreignDir string

	mu         sync.Mutex
	rebuilding map[string]bool // replica ids with a detached rebuild running
	// rebuildFailures counts each replica's detached rebuild attempts
	// that failed in a row: each next attempt reads the next source.
	rebuildFailures map[string]int
	tasks           map[string]bool // snapshot cuts, clone copies and merges running (snapshots.go)
	// taskFailures counts each task's attempts that failed in a row,
	// which pace its retries (runTask).
	taskFailures map[string]int
	// failures paces the reports of each failed local replica
	// (reportFailed).
	failures map[string]*failureReports

	wg sync.WaitGroup
}

// dataRoles are the identities the data port admits under TLS: servers
// (rebuilds, clones, detached snapshots), CSI nodes and operators (the
// engines of attached volumes).
var dataRoles = []pki.Role{pki.RoleServer, pki.RoleCSINode, pki.RoleOperator}

func (s *Server) startDataPlane() error {
	cfg := &s.cfg
	store, err := replica.OpenStore(replica.Config{Dir: filepath.Join(cfg.DataDir, "replicas"), FS: cfg.ReplicaFS, Logger: s.logger})
	if err != nil {
		return fmt.Errorf("server: replica store: %w", err)
	}
	for id, derr := range store.Damaged() {
		s.logger.Error("damaged replica left in place for inspection", "replica", id, "err", derr)
	}
	d := &dataPlane{s: s, store: store, view: s.store.View, catchUp: s.catchUp, dataDirID: s.store.DataDirID(), rebuilding: map[string]bool{}, tasks: map[string]bool{}}
	d.lis = cfg.DataListener
	if d.lis == nil {
		if d.lis, err = net.Listen("tcp", cfg.DataListen); err != nil {
			store.Close()
			return fmt.Errorf("server: data listen: %w", err)
		}
	}
	if cfg.DataAdvertise == "" {
		cfg.DataAdvertise = d.lis.Addr().String()
	}
	if cfg.TLS != nil {
		d.lis = cfg.TLS.Listener(d.lis, dataRoles...)
		if cfg.DataIdentify == nil {
			cfg.DataIdentify = tlsDataIdentity
		}
	}
	access := newDataAccess(s)
	d.sources = newCopySources(s, access)
	wcfg := dataConfig(cfg.Data, s.logger, access, cfg.DataIdentify)
	wcfg.CopySource = d.sources
	d.wire, err = wire.NewServer(wire.BackendFunc(func(id string) (wire.Replica, error) {
		r, err := store.Get(id)
		if err != nil {
			return nil, err
		}
		return r, nil
	}), wcfg)
	if err != nil {
		d.lis.Close()
		store.Close()
		return err
	}
	access.engineHolds = d.wire.HasHandle // before the service serves
	if cfg.LocalSocket != "" {
		ln, err := localread.Listen(cfg.LocalSocket)
		if err != nil {
			d.lis.Close()
			store.Close()
			return fmt.Errorf("server: --local-socket: %w", err)
		}
		d.local = localread.NewServer(store, cfg.ID, s.logger)
		d.local.RequireHandles(d.wire.HasHandle)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			if err := d.local.Serve(ln); err != nil && s.ctx.Err() == nil {
				s.logger.Error("short-circuit read service stopped", "err", err)
			}
		}()
		s.logger.Info("short-circuit reads served", "socket", cfg.LocalSocket)
	}
	s.data = d
	d.wg.Add(2)
	go func() {
		defer d.wg.Done()
		if err := d.wire.Serve(d.lis); err != nil && s.ctx.Err() == nil {
			s.logger.Error("replica data service stopped", "err", err)
		}
	}()
	go func() {
		defer d.wg.Done()
		d.loop()
	}()
	return nil
}

// close stops the data service and the loop, waits for rebuilds, and
// closes the store. The server's context is already cancelled.
func (d *dataPlane) close() error {
	d.sources.Close() // before the data service: its copies in flight fail at once
	err := d.wire.Close()
	if d.local != nil {
		d.local.Close()
	}
	d.wg.Wait()
	return errors.Join(err, d.store.Close())
}

func (d *dataPlane) loop() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		d.reconcile()
		select {
		case <-d.s.ctx.Done():
			return
		case <-d.s.store.Changed():
		case <-t.C:
		}
	}
}

type placed struct {
	vol *storpb.Volume
	rep *storpb.Replica
}

// clusterView is what the data plane reconciles against: every volume
// (deleted ones kept for their snapshots included), snapshot and server,
// read in one transaction at one applied index. A reconcile and the
// tasks it starts share it: it is read only.
type clusterView struct {
	index   uint64
	vols    map[string]*storpb.Volume
	snaps   map[string]*storpb.Snapshot
	servers map[string]*storpb.Server
	self    *storpb.Server // this server's record; nil if it has none
}

// readClusterView returns the cluster's state as view now shows it: last
// itself if the state machine has applied nothing since last was read
// (the same applied index is the same state: every change to it is an
// applied entry), else a new read. On an error it returns what it read
// before it (the volumes up to an undecodable record, say), or nil. A reconcile runs every second and
// after every change; at 10,000 volumes and 50,000 snapshots a read
// decodes them all, about 150 ms of a core (docs/BENCHMARKS.md), which
// an idle cluster no longer pays every second.
func readClusterView(view func(func(*raftstore.Reader) error) error, last *clusterView, me string) (*clusterView, error) {
	var out *clusterView
	err := view(func(r *raftstore.Reader) error {
		idx := r.AppliedIndex()
		if last != nil && idx != 0 && last.index == idx {
			out = last
			return nil
		}
		cv := &clusterView{index: idx, vols: map[string]*storpb.Volume{}, snaps: map[string]*storpb.Snapshot{}, servers: map[string]*storpb.Server{}}
		out = cv
		// Its own server's record first, by itself: a reconcile does
		// nothing without it (ownsPlacements).
		self, err := r.Server(me)
		if err != nil && !errors.Is(err, raftstore.ErrNotFound) {
			return err
		}
		cv.self = self
		vols, _, err := r.Volumes("", 0)
		for _, v := range vols {
			cv.vols[v.Id] = v
		}
		if err != nil {
			return err
		}
		snaps, _, err := r.Snapshots("", "", 0)
		if err != nil {
			return err
		}
		for _, s := range snaps {
			cv.snaps[s.Id] = s
		}
		srvs, err := r.Servers()
		if err != nil {
			return err
		}
		for _, s := range srvs {
			cv.servers[s.Id] = s
		}
		return nil
	})
	return out, err
}

// ownsPlacements reports whether the replicas the cluster places on this
// server, as rec (its record, nil if not read) says, are this data dir's:
// the record names this dir, or names none (a record of an older
// version) while this dir holds replicas (a dir in use before). A data
// dir wiped or replaced, which holds none, waits for a record that names
// it (it joins afresh once removed; raftstore's dataDirMatches refuses it
// until then), so that a replica the cluster has as healthy is never
// made again here, empty.
func (d *dataPlane) ownsPlacements(rec *storpb.Server) bool {
	switch {
	case jepsenIgnoreDataDir:
		return true
	case rec == nil:
		return false
	case rec.DataDirId == d.dataDirID:
		return true
	case rec.DataDirId == "":
		return len(d.store.List()) > 0
	}
	return false
}

// reconcile makes the local replicas what the cluster places here. From
// a state that cannot be read in full it does only what moves forward
// (creating, fencing and rebuilding the replicas of the volumes it read);
// it deletes nothing and starts no snapshot work: a replica missing from
// a partial read would be taken for one no longer placed here and
// deleted.
func (d *dataPlane) reconcile() {
	view, readErr := readClusterView(d.view, d.last, d.s.cfg.ID)
	if readErr != nil {
		d.s.logger.Warn("the cluster's state could not be read in full: local replicas are created and fenced from what was read, none is deleted and no snapshot work starts until it reads", "err", readErr)
		if view == nil {
			return
		}
	} else {
		d.last = view
	}
	me := d.s.cfg.ID
	if rec := view.self; !d.ownsPlacements(rec) {
		// The replicas the cluster places here (if any) are not this
		// data dir's to make: nothing is made, fenced or deleted.
		said := "none"
		if rec != nil {
			said = "dir " + rec.DataDirId
		}
		switch {
		case said == d.foreignDir:
		case rec.GetDataDirId() != "":
			d.s.logger.Warn("the cluster's record of this server names another data dir: no replica is made, fenced or deleted here until it names this one (a wiped or replaced data dir: remove the server and it joins afresh)",
				"recorded_data_dir_id", rec.DataDirId, "data_dir_id", d.dataDirID)
		case rec == nil && readErr == nil && len(d.store.List()) > 0:
			d.s.logger.Warn("the cluster has no record of this server (removed?): its local replicas are kept, and none is made, fenced or deleted here until it joins again")
		}
		d.foreignDir = said
		return
	}
	d.foreignDir = ""
	desired := map[string]placed{}
	for _, v := range view.vols {
		for _, rep := range v.Replicas {
			if rep.ServerId == me && !rep.ServerRemoved {
				desired[rep.Id] = placed{v, rep}
			}
		}
	}
	damaged := d.store.Damaged()
	for id, p := range desired {
		if err := damaged[id]; err != nil {
			if diskFailure(err) {
				d.reportFailed(p, fmt.Errorf("damaged: %w", err))
			}
			continue
		}
		r, err := d.store.Create(replica.Spec{ID: id, VolumeID: p.vol.Id, Size: p.vol.SizeBytes, VolumeName: p.vol.Name})
		grown := err == nil
		if err != nil {
			d.s.logger.Warn("create replica", "replica", id, "volume", p.vol.Name, "volume_id", p.vol.Id, "err", err)
			if diskFailure(err) {
				d.reportFailed(p, err)
			}
			// A replica that exists but could not be grown (its new
			// meta.json could not be written) is still fenced below: the
			// fence rewrites a slot of a file it has, and an engine of an
			// older epoch must not go on writing to it.
			if r, err = d.store.Get(id); err != nil || r.VolumeID() != p.vol.Id {
				continue
			}
		}
		if err := r.Failed(); err != nil {
			d.reportFailed(p, err)
			continue
		}
		if r.Epoch() < p.vol.Epoch {
			if err := r.Fence(p.vol.Epoch); err != nil {
				d.s.logger.Warn("fence replica", "replica", id, "epoch", p.vol.Epoch, "err", err)
				if diskFailure(err) {
					d.reportFailed(p, err)
				}
				continue
			}
		}
		if !grown {
			continue
		}
		if p.rep.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			d.forgetFailures(id) // it works (again): its next failure is reported at once
		}
		if detachedRebuildDue(p.vol, p.rep) {
			d.startRebuild(p.vol, p.rep)
		}
	}
	if readErr != nil {
		return
	}
	d.forgetReplicasGone(desired)
	d.reconcileSnapshots(desired, view)
	var stale []*replica.Replica
	for _, r := range d.store.List() {
		if _, ok := desired[r.ID()]; !ok {
			stale = append(stale, r)
		}
	}
	if len(stale) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(d.s.ctx, 5*time.Second)
	defer cancel()
	if err := d.catchUp(ctx); err != nil {
		return // not sure our view is current: keep the data for now
	}
	for _, r := range stale {
		id := r.ID()
		err := d.store.Delete(id)
		if _, gerr := d.store.Get(id); errors.Is(gerr, replica.ErrNotFound) {
			// Gone from the store, even if its delete then failed (to
			// sync the directory, say): no later reconcile lists it.
			d.wire.Forget(id)
		}
		if err != nil && !errors.Is(err, replica.ErrNotFound) {
			d.s.logger.Warn("delete replica", "replica", id, "err", err)
			continue
		}
		name := "(deleted)"
		if v := view.vols[r.VolumeID()]; v != nil {
			name = v.Name
		}
		d.s.logger.Info("deleted replica no longer placed here", "replica", id, "volume", name, "volume_id", r.VolumeID())
	}
}

func (d *dataPlane) startRebuild(v *storpb.Volume, r *storpb.Replica) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.rebuilding[r.Id] || d.s.ctx.Err() != nil {
		return
	}
	d.rebuilding[r.Id] = true
	failures := d.rebuildFailures[r.Id]
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		err := d.rebuild(v, r, failures)
		if err != nil && d.s.ctx.Err() == nil {
			d.s.logger.Warn("rebuild of detached volume failed; will retry", "volume", v.Name, "volume_id", v.Id, "replica", r.Id, "err", err)
			if diskFailure(err) && !engine.IsSourceError(err) {
				d.reportFailed(placed{v, r}, err) // the target's: this server's disk
			}
			select { // back off before the next attempt
			case <-d.s.ctx.Done():
			case <-time.After(2 * time.Second):
			}
		}
		d.mu.Lock()
		delete(d.rebuilding, r.Id)
		if d.rebuildFailures == nil {
			d.rebuildFailures = map[string]int{}
		}
		if err != nil {
			d.rebuildFailures[r.Id]++
		} else {
			delete(d.rebuildFailures, r.Id)
		}
		d.mu.Unlock()
	}()
}

// failureReports paces the reports of one failed local replica.
type failureReports struct {
	running bool          // a report is in flight
	next    time.Time     // no report before
	wait    time.Duration // from the last report to the next
}

// A failed replica is reported at most every failureReportWait at first,
// the wait doubling after each report, up to failureReportMaxWait.
const (
	failureReportWait    = 2 * time.Second
	failureReportMaxWait = time.Minute
)

// reportFailed records a replica placed here FAULTY because this server's
// disk failed it: the replica failed (a sync the disk failed fails it
// until the server restarts), could not be opened (damaged), or this
// server's own request of it (its creation, a fence, a detached rebuild
// writing it) met a disk error (diskFailure). Nothing else would while
// its volume is detached: every rebuild of it, and every task reading it,
// failed, and the replica stayed REBUILDING (or HEALTHY) for ever, its
// volume a copy short without anyone told. Once FAULTY it is replaced
// elsewhere after the cluster's replacement wait; a disk error that was
// passing costs a rebuild of it.
//
// An attached volume's replicas are left to its engine, which records the
// replicas that fail its requests. The leader sets a FAULTY replica of a
// server it hears from REBUILDING again, to catch up; this replica cannot,
// and is reported again, at a wait that doubles up to
// failureReportMaxWait: the leader replaces it at its first look at it
// FAULTY past the replacement wait, so at most that much late.
func (d *dataPlane) reportFailed(p placed, cause error) {
	v, rep := p.vol, p.rep
	if v.Attachment != nil || v.State == storpb.VolumeState_VOLUME_STATE_DELETED || rep.State == storpb.ReplicaState_REPLICA_STATE_FAULTY {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	f := d.failures[rep.Id]
	if f == nil {
		if d.failures == nil {
			d.failures = map[string]*failureReports{}
		}
		f = &failureReports{wait: failureReportWait}
		d.failures[rep.Id] = f
	}
	if f.running || time.Now().Before(f.next) || d.s.ctx.Err() != nil {
		return
	}
	f.running = true
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		ctx, cancel := context.WithTimeout(d.s.ctx, recordTimeout)
		defer cancel()
		vols := storpb.NewVolumeServiceClient(d.s.selfConn())
		_, err := vols.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
			VolumeId: v.Id, ReplicaId: rep.Id, State: storpb.ReplicaState_REPLICA_STATE_FAULTY,
			Epoch: v.Epoch, Reason: fmt.Sprintf("failed on server %s: %v", d.s.cfg.ID, cause),
		})
		log := d.s.logger.With("volume", v.Name, "volume_id", v.Id, "replica", rep.Id, "cause", cause)
		d.mu.Lock()
		defer d.mu.Unlock()
		f.running = false
		f.next = time.Now().Add(f.wait)
		f.wait = min(2*f.wait, failureReportMaxWait)
		switch {
		case status.Code(err) == codes.FailedPrecondition:
			log.Error("a replica failed here and could not be recorded faulty: the volume has no other healthy replica to serve its data; restart this server (or restore its disk) to serve it again",
				"err", err, "retry_in", time.Until(f.next).Round(time.Second))
			return
		case err != nil:
			log.Warn("a replica failed here and could not be recorded faulty; will retry", "err", err, "retry_in", time.Until(f.next).Round(time.Second))
			return
		}
		log.Warn("a replica failed here; recorded it faulty, to be replaced")
	}()
}

// diskFailure reports whether err is a disk's failure of a replica
// request: an I/O error, a full disk, or data that fails validation. The
// process's own limits and rights are not the disk's (out of file
// descriptors or memory, a permission refused: a data directory restored
// with the wrong owner, say): a restart with the right ones serves the
// replica again, where a replica recorded FAULTY is replaced, and a
// snapshot whose last copy it held lost.
func diskFailure(err error) bool {
	for _, errno := range []error{syscall.EMFILE, syscall.ENFILE, syscall.ENOMEM, syscall.EACCES, syscall.EPERM} {
		if errors.Is(err, errno) {
			return false
		}
	}
	return errors.Is(err, replica.ErrIO) || errors.Is(err, replica.ErrNoSpace) || errors.Is(err, replica.ErrCorrupt)
}

// forgetFailures drops the pace of replica id's failure reports.
func (d *dataPlane) forgetFailures(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if f := d.failures[id]; f != nil && !f.running {
		delete(d.failures, id)
	}
}

// forgetReplicasGone drops what the data plane keeps of the replicas of
// its past attempts (failed rebuilds, failure reports) that are no
// longer placed here.
func (d *dataPlane) forgetReplicasGone(desired map[string]placed) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id := range d.rebuildFailures {
		if _, ok := desired[id]; !ok {
			delete(d.rebuildFailures, id)
		}
	}
	for id, f := range d.failures {
		if _, ok := desired[id]; !ok && !f.running {
			delete(d.failures, id)
		}
	}
}

// rebuildSource reports whether rep may be read to rebuild another
// replica of v: a HEALTHY one and, while v is a clone being filled
// (CREATING), one whose copy of the snapshot is done. A clone's replicas
// are HEALTHY from their creation, before their copy fills them: a
// rebuild read from one not yet filled wrote its holes over the target,
// whose own copy may already have filled it and been counted done
// (CloneDoneReplicaIds is never taken back), and the clone then became
// AVAILABLE with a replica reading zeroes.
func rebuildSource(v *storpb.Volume, rep *storpb.Replica) bool {
	if rep.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		return false
	}
	return v.State != storpb.VolumeState_VOLUME_STATE_CREATING || slices.Contains(v.CloneDoneReplicaIds, rep.Id)
}

// detachedRebuildDue reports whether this server rebuilds its replica rep
// of v itself: rep is REBUILDING, v is detached (an attached volume's
// engine rebuilds its replicas), and another replica may be read. Not
// while a snapshot of v is pending: its detached cut opens the replicas
// at an epoch of its own and reconciles their dirty regions with writes to
// every one, the target included, which a rebuild at that epoch would
// race (it copies with no write ordering: nothing else writes a detached
// volume), and the target could end up holding a write the others were
// just made not to hold. A rebuild started before the cut is fenced by
// the cut's epoch; the next starts once the cut is recorded.
func detachedRebuildDue(v *storpb.Volume, rep *storpb.Replica) bool {
	return rep.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING && v.Attachment == nil &&
		len(v.PendingSnapshotIds) == 0 && hasRebuildSource(v, rep.Id)
}

// hasRebuildSource reports whether a replica of v other than target may
// be read to rebuild it (rebuildSource). A clone's replica with none
// waits: its own copy fills it meanwhile, and once another replica's copy
// is done it is rebuilt from that one.
func hasRebuildSource(v *storpb.Volume, target string) bool {
	return slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool { return r.Id != target && rebuildSource(v, r) })
}

// rebuild copies a detached volume's data into the local rebuilding
// replica at the volume's current epoch. An attach during the copy raises
// the epoch on the replicas, which refuse the rest of this copy; the
// attached engine then rebuilds the replica itself. failures is how many
// attempts failed before this one: the copy reads the source after the
// one the last attempt read, so that a source that fails, or that takes
// requests and never answers them (each request is bounded by
// TaskIOTimeout), does not fail every attempt.
func (d *dataPlane) rebuild(v *storpb.Volume, r *storpb.Replica, failures int) error {
	ctx := d.s.ctx
	servers := map[string]*storpb.Server{}
	_ = d.s.store.View(func(rd *raftstore.Reader) error {
		list, err := rd.Servers()
		for _, s := range list {
			servers[s.Id] = s
		}
		return err
	})
	connect := engine.WireConnector(wire.ClientConfig{Dial: d.s.dialData})
	// Every open states the rebuild of r on this server (dataauth.go).
	open := func(rep *storpb.Replica) (engine.ReplicaConn, error) {
		srv := servers[rep.ServerId]
		if srv == nil {
			return nil, fmt.Errorf("server %q unknown", rep.ServerId)
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return connect(cctx, srv.DataAddress, wire.OpenRequest{
			Replica: rep.Id, Volume: v.Id, Node: d.s.cfg.ID, Epoch: v.Epoch, Purpose: wire.PurposeRebuild,
		})
	}
	var history []engine.ReplicaConn
	var historyIDs []string
	defer func() {
		for _, c := range history {
			closeWithin(c, closeTimeout)
		}
	}()
	for _, rep := range v.Replicas {
		if !rebuildSource(v, rep) {
			continue
		}
		c, err := open(rep)
		if err != nil {
			d.s.logger.Warn("rebuild source unavailable", "replica", rep.Id, "err", err)
			continue
		}
		history = append(history, c)
		historyIDs = append(historyIDs, rep.Id)
	}
	if len(history) == 0 {
		return fmt.Errorf("no healthy replica of %s reachable", v.Name)
	}
	k := failures % len(history)
	history = slices.Concat(history[k:], history[:k])
	historyIDs = slices.Concat(historyIDs[k:], historyIDs[:k])
	dst, err := open(r)
	if err != nil {
		return fmt.Errorf("open target: %w", err)
	}
	defer closeWithin(dst, closeTimeout)

	vols := storpb.NewVolumeServiceClient(d.s.selfConn())
	start := time.Now()
	stats, err := engine.Rebuild(ctx, replica.Op{Epoch: v.Epoch, Generation: v.Generation},
		engine.RebuildSource{Read: history[0], ReadID: historyIDs[0], History: history}, dst,
		engine.RebuildPlan{FromGeneration: r.RebuildFromGeneration, Size: int64(v.SizeBytes), ResumeFrom: int64(r.RebuildResumeOffset),
			RequestTimeout: d.s.cfg.TaskIOTimeout},
		engine.ProgressReports(ctx, vols, v.Id, r, v.Epoch))
	if err != nil {
		return err
	}
	// A record the control plane does not take in time fails this
	// attempt, which is then retried: a rebuild that waited here without
	// a deadline (for a leader whose disk hangs, say) would hold the
	// replica's entry in d.rebuilding, and so its next attempt, until the
	// server restarted.
	rctx, cancel := context.WithTimeout(ctx, recordTimeout)
	defer cancel()
	if _, err := vols.SetReplicaState(rctx, &storpb.SetReplicaStateRequest{
		VolumeId: v.Id, ReplicaId: r.Id, State: storpb.ReplicaState_REPLICA_STATE_HEALTHY,
		Epoch: v.Epoch, Generation: r.Generation, Reason: "rebuild complete (detached)",
	}); err != nil {
		return fmt.Errorf("record rebuild: %w", err)
	}
	d.s.logger.Info("rebuild complete", "volume", v.Name, "volume_id", v.Id, "replica", r.Id, "delta", stats.Delta,
		"bytes", stats.Bytes, "copied_by_target", stats.Copied, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// handshakeTimeout bounds the TLS handshake tlsDataIdentity completes.
const handshakeTimeout = 10 * time.Second

// tlsDataIdentity is the identity of a data connection's peer from its
// certificate (the TLS listener already refused every peer without one
// of dataRoles): what dataauth.go's speaksFor checks an OPEN against. A
// handshake that fails leaves the peer unverified, and the connection
// fails at its first read anyway.
func tlsDataIdentity(conn net.Conn) wire.Identity {
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	defer cancel()
	id, err := pki.ConnIdentity(ctx, conn)
	if err != nil {
		return wire.Identity{}
	}
	return wire.Identity{Verified: true, Role: string(id.Role), Name: id.Name}
}

// closeTimeout bounds the CLOSE a data-plane task sends as it ends. It is
// sent after the task's context may have ended (the server shutting down,
// which waits for the task), so it cannot use that context, and a peer
// that never answers must not hold the shutdown.
const closeTimeout = 5 * time.Second

// recordTimeout bounds the control call that records a rebuild of a
// detached volume complete.
const recordTimeout = 10 * time.Second

// closeWithin closes c, waiting at most d for the server's answer.
func closeWithin(c interface{ Close(context.Context) error }, d time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_ = c.Close(ctx)
}
