package server

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// The replica data service authorises each OPEN, and each request on the
// handle it grants, against this server's applied Raft state (dataAccess).
// An OPEN names the replica, its volume, the epoch, the node and its
// purpose (wire.OpenRequest); it is accepted only when:
//
//   - the volume exists and lists the replica, on this server;
//   - the epoch is the volume's committed epoch. An epoch above it is
//     refused, always: nobody can fence a volume beyond what Raft has
//     committed (with epoch 2^64-1, say, which no attach could ever pass).
//     A lower one is ErrStaleEpoch, as the replica would say;
//   - by purpose:
//     attach: the volume is attached to Node;
//     rebuild: the volume is detached and Node is the server of one of its
//     rebuilding replicas (the detached rebuild, dataplane.go);
//     snapshot-cut: the volume is detached, has pending snapshots, and
//     Node is a server (engine.CutDetached, at the epoch its DetachVolume
//     with FenceDetached committed);
//     clone-copy: Snapshot is a ready snapshot of the volume that this
//     replica holds, and a clone of it still being created has a replica
//     on server Node that is not filled yet (copyFrom);
//     inspect: the peer is a verified operator (or InsecureDataInspect is
//     set, for test harnesses);
//     rebuild-source: the replica is healthy, and Node is the server of one
//     of the volume's rebuilding replicas, attached volume or not (its
//     server reads the replica for the REBUILD_COPY requests its target
//     serves; copysource.go); for an attached volume, the engine must
//     also hold the replica open through this server process
//     (engineHolds): after a crash and restart of this server, which
//     loses the writes a replica acknowledged since its last flush, the
//     replica is still HEALTHY until the engine's next request fails on
//     the connection that died, and a copy from it would give the target
//     the holes;
//
// A handle may then do only what its purpose needs: a clone copy reads
// that snapshot's layers (EXTENTS, SNAPSHOT_READ), an inspection reads
// (READ, EXTENTS, SNAPSHOT_READ), a rebuild reads its sources and only
// rebuild-writes (and flushes) its target. Every request's epoch must not
// exceed the handle's (a request at a higher epoch would raise the
// replica's: fence it), nor its generation the volume's committed
// generation; GROW may not exceed the volume's committed size;
// SNAPSHOT_CREATE only cuts, at the handle's epoch, a snapshot the volume
// has pending; SNAPSHOT_READ and EXTENTS of a layer only of a snapshot the
// metadata lists for the volume (an inspection reads any layer the replica
// holds); SNAPSHOT_DELETE only of a layer the metadata does not keep
// (strayLayer: a layer of a snapshot that is gone, or one that snapshot's
// record says this replica missed or lost).
//
// This server may lag the Raft log: an engine opens its replicas as soon
// as the leader has applied its attach, and a follower may not have. So a
// refusal that a later entry could lift (an epoch or size above what is
// applied here, an attachment, replica or snapshot not seen yet) is
// checked again once this server has caught up with the leader's applied
// index (catchUp, retried while the leader cannot be reached), waiting at
// most dataAuthWait; only then is it final.
//
// Identities. Who the peer is comes from wire.ServerConfig.Identify, which
// the TLS layer fills from the client certificate. Without it (every peer
// unverified) what is enforced is the metadata: nobody can open a replica
// at an epoch above the committed one, a replica of a volume that is not
// attached to the node named, or for a server's purpose the metadata does
// not call for, nor read, write, grow or change snapshots beyond what the
// grant allows. What needs the identity: that the named node is the peer.
// An unverified peer can still name the node a volume is attached to and
// open it at the committed epoch, then read and write it as that node's
// engine could (it cannot fence that engine, grow the volume or touch
// snapshots beyond the metadata; stating the replica's generation as its
// incarnation, it can make the engine's handles older, which stops the
// engine's writes to it: wire's doc, "Incarnations"); or name the server doing a detached
// rebuild, cut or clone copy while one is due, with that purpose's
// requests; or name a server with a rebuilding replica of a volume and
// read a healthy replica of it as that rebuild's source (rebuild-source),
// attached volume or not (what the purpose rebuild already lets it read
// of a detached volume). With a verified identity, attach needs a csi-node certificate
// for Node or an operator, the server purposes a server certificate for
// Node, and inspect an operator.
//
// A rebuild-source handle only reads (READ). A REBUILD_COPY is a rebuild
// write: a handle that may rebuild-write its replica (an attach, a
// detached rebuild's target) may ask for one.

// dataAuthWait bounds how long an OPEN or request waits for this server
// to catch up before a refusal that a later entry could lift is final.
const dataAuthWait = 5 * time.Second

// errLagging marks a refusal that a Raft entry not yet applied here could
// lift: it is checked again after catching up.
var errLagging = errors.New("not in this server's applied metadata")

// metaView is what the checks read of the applied metadata
// (*raftstore.Reader).
type metaView interface {
	Volume(id string) (*storpb.Volume, error)
	Volumes(token string, limit int) ([]*storpb.Volume, string, error)
	Snapshot(id string) (*storpb.Snapshot, error)
	Server(id string) (*storpb.Server, error)
}

// dataAccess is the data service's wire.Authorizer.
type dataAccess struct {
	me string // this server's id
	// view reads the applied metadata; catchUp waits until this server
	// has applied what the leader had when it was called.
	view    func(fn func(metaView) error) error
	catchUp func(ctx context.Context) error
	wait    time.Duration
	// insecureInspect lets an unverified peer open for inspection.
	insecureInspect bool
	// engineHolds reports whether the engine attached at an epoch holds a
	// replica open through this server process (wire.Server.HasHandle);
	// nil: not checked.
	engineHolds func(replica string, epoch uint64) bool
}

func newDataAccess(s *Server) *dataAccess {
	return &dataAccess{
		me: s.cfg.ID,
		view: func(fn func(metaView) error) error {
			return s.store.View(func(r *raftstore.Reader) error { return fn(r) })
		},
		catchUp:         s.catchUp,
		wait:            dataAuthWait,
		insecureInspect: s.cfg.InsecureDataInspect,
	}
}

// decide runs check on the applied metadata; a refusal wrapping
// errLagging is checked again once this server has caught up.
// This server may not reach the leader at first (an election, a brief
// partition): catching up is retried until dataAuthWait has passed.
func (a *dataAccess) decide(ctx context.Context, check func(metaView) error) error {
	err := a.view(check)
	if err == nil || !errors.Is(err, errLagging) {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, a.wait)
	defer cancel()
	for backoff := 20 * time.Millisecond; ; backoff = min(2*backoff, 500*time.Millisecond) {
		cerr := a.catchUp(cctx)
		if cerr == nil {
			return a.view(check)
		}
		select {
		case <-cctx.Done():
			return fmt.Errorf("%w (and this server could not catch up: %v)", err, cerr)
		case <-time.After(backoff):
		}
		if err = a.view(check); err == nil || !errors.Is(err, errLagging) {
			return err // applied meanwhile
		}
	}
}

func denied(format string, args ...any) error {
	return fmt.Errorf("server: "+format+": %w", append(args, wire.ErrDenied)...)
}

// lagging is denied, marked as a refusal a later entry could lift.
func lagging(format string, args ...any) error {
	return fmt.Errorf("server: "+format+": %w (%w)", append(args, wire.ErrDenied, errLagging)...)
}

// Open implements wire.Authorizer.
func (a *dataAccess) Open(ctx context.Context, p wire.Peer, r wire.OpenRequest) (wire.Grant, error) {
	if err := speaksFor(p.Identity, r, a.insecureInspect); err != nil {
		return nil, err
	}
	var g *dataGrant
	err := a.decide(ctx, func(m metaView) error {
		var err error
		g, err = a.checkOpen(m, r)
		return err
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// speaksFor checks the peer's identity against the open; an unverified
// peer passes (see the comment at the top), except for inspection.
func speaksFor(id wire.Identity, r wire.OpenRequest, insecureInspect bool) error {
	if !id.Verified {
		if r.Purpose == wire.PurposeInspect && !insecureInspect {
			return denied("OPEN %s for inspection: only a verified operator may inspect replicas", r.Replica)
		}
		return nil
	}
	ok := false
	switch r.Purpose {
	case wire.PurposeAttach:
		ok = id.Role == "operator" || (id.Role == "csi-node" && id.Name == r.Node)
	case wire.PurposeRebuild, wire.PurposeSnapshotCut, wire.PurposeCloneCopy, wire.PurposeRebuildSource:
		ok = id.Role == "server" && id.Name == r.Node
	case wire.PurposeInspect:
		ok = id.Role == "operator"
	}
	if !ok {
		return denied("OPEN %s for %v by %s %q as %q: not this identity's to open", r.Replica, r.Purpose, id.Role, id.Name, r.Node)
	}
	return nil
}

// checkOpen is the rule set at the top of this file for an OPEN.
func (a *dataAccess) checkOpen(m metaView, r wire.OpenRequest) (*dataGrant, error) {
	if r.Purpose == wire.PurposeNone || r.Volume == "" {
		return nil, denied("OPEN %s states no volume or purpose", r.Replica)
	}
	v, err := m.Volume(r.Volume)
	if errors.Is(err, raftstore.ErrNotFound) {
		return nil, fmt.Errorf("server: OPEN %s: volume %s: %w (%w)", r.Replica, r.Volume, replica.ErrNotFound, errLagging)
	} else if err != nil {
		return nil, err
	}
	rep := replicaOf(v, r.Replica)
	switch {
	case rep == nil:
		return nil, fmt.Errorf("server: OPEN %s: not a replica of volume %s: %w (%w)", r.Replica, v.Name, replica.ErrNotFound, errLagging)
	case rep.ServerId != a.me:
		return nil, denied("OPEN %s: the replica is on server %s, not this one", r.Replica, rep.ServerId)
	case r.Epoch > v.Epoch:
		return nil, lagging("OPEN %s at epoch %d: above volume %s's committed epoch %d", r.Replica, r.Epoch, v.Name, v.Epoch)
	case r.Epoch < v.Epoch:
		return nil, fmt.Errorf("server: OPEN %s at epoch %d: volume %s is at epoch %d: %w", r.Replica, r.Epoch, v.Name, v.Epoch, replica.ErrStaleEpoch)
	}
	switch r.Purpose {
	case wire.PurposeAttach:
		if at := v.Attachment; at == nil || at.NodeId != r.Node {
			return nil, lagging("OPEN %s: volume %s is not attached to node %q", r.Replica, v.Name, r.Node)
		}
		if r.Incarnation > rep.Generation {
			return nil, lagging("OPEN %s as incarnation %d: the replica is at generation %d", r.Replica, r.Incarnation, rep.Generation)
		}
	case wire.PurposeRebuild:
		if v.Attachment != nil {
			return nil, lagging("OPEN %s for a rebuild: volume %s is attached (its engine rebuilds)", r.Replica, v.Name)
		}
		if !slices.ContainsFunc(v.Replicas, func(x *storpb.Replica) bool {
			return x.ServerId == r.Node && x.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING
		}) {
			return nil, lagging("OPEN %s for a rebuild: volume %s has no rebuilding replica on server %q", r.Replica, v.Name, r.Node)
		}
		// A source (any replica but the rebuilding one: rebuildSource).
		if !(rep.ServerId == r.Node && rep.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING) && !rebuildSource(v, rep) {
			return nil, lagging("OPEN %s for a rebuild: not a healthy replica of volume %s (of a clone being filled, not a filled one)", r.Replica, v.Name)
		}
	case wire.PurposeSnapshotCut:
		if v.Attachment != nil || len(v.PendingSnapshotIds) == 0 {
			return nil, lagging("OPEN %s for a snapshot cut: volume %s is attached or has no pending snapshot", r.Replica, v.Name)
		}
		if err := a.isServer(m, r.Node); err != nil {
			return nil, err
		}
	case wire.PurposeCloneCopy:
		if err := a.checkClone(m, v, r); err != nil {
			return nil, err
		}
	case wire.PurposeRebuildSource:
		if err := checkRebuildSource(v, r.Replica, r.Node); err != nil {
			return nil, err
		}
		if v.Attachment != nil && a.engineHolds != nil && !a.engineHolds(r.Replica, r.Epoch) {
			return nil, denied("OPEN %s as a rebuild source at epoch %d: volume %s's engine does not hold the replica open through this server process (it restarted since?), which may have lost writes acknowledged since its last flush",
				r.Replica, r.Epoch, v.Name)
		}
	case wire.PurposeInspect:
	default:
		return nil, denied("OPEN %s: unknown purpose %v", r.Replica, r.Purpose)
	}
	g := &dataGrant{a: a, open: r}
	g.rebuildTarget = r.Purpose == wire.PurposeRebuild && rep.ServerId == r.Node && rep.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING
	g.gen.Store(v.Generation)
	return g, nil
}

func (a *dataAccess) isServer(m metaView, id string) error {
	if _, err := m.Server(id); errors.Is(err, raftstore.ErrNotFound) {
		return lagging("%q is not a server of this cluster", id)
	} else if err != nil {
		return err
	}
	return nil
}

// checkClone: snapshot r.Snapshot of v is ready and held by the replica,
// and a clone of it being created has an unfilled replica on server
// r.Node.
func (a *dataAccess) checkClone(m metaView, v *storpb.Volume, r wire.OpenRequest) error {
	s, err := m.Snapshot(r.Snapshot)
	if errors.Is(err, raftstore.ErrNotFound) {
		return lagging("OPEN %s for a clone copy: snapshot %q not found", r.Replica, r.Snapshot)
	} else if err != nil {
		return err
	}
	if s.VolumeId != v.Id || !s.ReadyToUse || !raftstore.SnapshotServes(s, r.Replica) {
		return lagging("OPEN %s for a clone copy: snapshot %s is not a ready snapshot of %s held by this replica", r.Replica, s.Name, v.Name)
	}
	vols, _, err := m.Volumes("", 0)
	if err != nil {
		return err
	}
	for _, c := range vols {
		if c.CloneSnapshotId != s.Id || c.State != storpb.VolumeState_VOLUME_STATE_CREATING {
			continue
		}
		for _, x := range c.Replicas {
			if x.ServerId == r.Node && !x.ServerRemoved && !slices.Contains(c.CloneDoneReplicaIds, x.Id) {
				return nil
			}
		}
	}
	return lagging("OPEN %s for a clone copy: no clone of snapshot %s being filled on server %q", r.Replica, s.Name, r.Node)
}

func replicaOf(v *storpb.Volume, id string) *storpb.Replica {
	for _, r := range v.Replicas {
		if r.Id == id && !r.ServerRemoved {
			return r
		}
	}
	return nil
}

// dataGrant is what one OPEN was granted: the requests of its purpose, at
// its epoch, within the metadata (the rules at the top of this file).
type dataGrant struct {
	a    *dataAccess
	open wire.OpenRequest
	// rebuildTarget: a rebuild's open of the replica it rebuilds (else a
	// rebuild reads a source).
	rebuildTarget bool
	// gen is a generation the volume is known to have reached: requests
	// up to it pass without reading the metadata.
	gen atomic.Uint64
}

// Allow implements wire.Grant.
func (g *dataGrant) Allow(ctx context.Context, r wire.Request) error {
	o := g.open
	if r.Epoch > o.Epoch {
		return denied("%v on %s at epoch %d: above the epoch %d it was opened at", r.Op, o.Replica, r.Epoch, o.Epoch)
	}
	if r.Generation > g.gen.Load() {
		if err := g.a.decide(ctx, func(m metaView) error { return g.checkGeneration(m, r.Generation) }); err != nil {
			return err
		}
		for cur := g.gen.Load(); cur < r.Generation && !g.gen.CompareAndSwap(cur, r.Generation); cur = g.gen.Load() {
		}
	}
	switch o.Purpose {
	case wire.PurposeCloneCopy:
		if r.Op != wire.OpExtents && r.Op != wire.OpSnapshotRead {
			return denied("%v on %s: a clone copy only reads snapshot %s", r.Op, o.Replica, o.Snapshot)
		}
		if sid, _, ok := replica.ParseLayerName(r.ID); !ok || sid != o.Snapshot {
			return denied("%v on %s of layer %q: a clone copy only reads snapshot %s", r.Op, o.Replica, r.ID, o.Snapshot)
		}
	case wire.PurposeInspect:
		if r.Op != wire.OpRead && r.Op != wire.OpExtents && r.Op != wire.OpSnapshotRead {
			return denied("%v on %s: an inspection only reads", r.Op, o.Replica)
		}
	case wire.PurposeRebuild:
		if !rebuildOps[r.Op] || (!g.rebuildTarget && rebuildWrites[r.Op]) {
			return denied("%v on %s: not a rebuild's (target: %v)", r.Op, o.Replica, g.rebuildTarget)
		}
	case wire.PurposeRebuildSource:
		if r.Op != wire.OpRead {
			return denied("%v on %s: a rebuild source only reads", r.Op, o.Replica)
		}
		// Every read, not only the OPEN: a source recorded faulty since
		// must not be copied from through a handle kept open.
		if err := g.a.decide(ctx, func(m metaView) error { return g.checkSource(m) }); err != nil {
			return err
		}
	}
	switch r.Op {
	case wire.OpGrow:
		return g.a.decide(ctx, func(m metaView) error { return g.checkGrow(m, r.Len) })
	case wire.OpSnapshotCreate:
		return g.a.decide(ctx, func(m metaView) error { return g.checkCut(m, r.ID) })
	case wire.OpSnapshotRead, wire.OpExtents:
		if r.ID == "" || o.Purpose == wire.PurposeInspect {
			return nil // EXTENTS of the head; an operator reads any layer there is
		}
		return g.a.decide(ctx, func(m metaView) error { return g.checkLayer(m, r.ID) })
	case wire.OpSnapshotDelete:
		// Deleting on a lagging view could drop a layer the metadata
		// keeps: catch up first, always.
		cctx, cancel := context.WithTimeout(ctx, g.a.wait)
		defer cancel()
		if err := g.a.catchUp(cctx); err != nil {
			return denied("SNAPSHOT_DELETE on %s of %s: cannot catch up with the leader to check it: %v", o.Replica, r.ID, err)
		}
		return g.a.view(func(m metaView) error { return g.checkDelete(m, r.ID) })
	}
	return nil
}

// rebuildOps are the requests a rebuild makes (engine.Rebuild); only its
// target takes rebuildWrites.
var (
	rebuildOps = map[wire.Opcode]bool{
		wire.OpRead: true, wire.OpExtents: true, wire.OpWrittenSince: true, wire.OpDirtyRegions: true,
		wire.OpRebuildBegin: true, wire.OpRebuildWrite: true, wire.OpRebuildEnd: true, wire.OpFlush: true,
		wire.OpRebuildCopy: true,
	}
	rebuildWrites = map[wire.Opcode]bool{
		wire.OpRebuildBegin: true, wire.OpRebuildWrite: true, wire.OpRebuildEnd: true, wire.OpFlush: true,
		wire.OpRebuildCopy: true,
	}
)

func (g *dataGrant) volume(m metaView) (*storpb.Volume, error) {
	v, err := m.Volume(g.open.Volume)
	if errors.Is(err, raftstore.ErrNotFound) {
		return nil, denied("volume %s is gone", g.open.Volume)
	}
	return v, err
}

// checkSource: the rebuild-source OPEN's rules still hold.
func (g *dataGrant) checkSource(m metaView) error {
	v, err := g.volume(m)
	if err != nil {
		return err
	}
	return checkRebuildSource(v, g.open.Replica, g.open.Node)
}

// checkRebuildSource: replica id is a healthy replica of v (while v is a
// clone being filled, one whose copy is done: rebuildSource), and server
// node holds a rebuilding one (the rebuild-source rule, at the OPEN and at
// every READ).
func checkRebuildSource(v *storpb.Volume, id, node string) error {
	if rep := replicaOf(v, id); rep == nil || !rebuildSource(v, rep) {
		return lagging("%s as a rebuild source: not a healthy replica of volume %s (of a clone being filled, not a filled one)", id, v.Name)
	}
	if !slices.ContainsFunc(v.Replicas, func(x *storpb.Replica) bool {
		return x.ServerId == node && x.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING && !x.ServerRemoved
	}) {
		return lagging("%s as a rebuild source: volume %s has no rebuilding replica on server %q", id, v.Name, node)
	}
	return nil
}

func (g *dataGrant) checkGeneration(m metaView, gen uint64) error {
	v, err := g.volume(m)
	if err != nil {
		return err
	}
	if gen > v.Generation {
		return lagging("request on %s at generation %d: volume %s is at generation %d", g.open.Replica, gen, v.Name, v.Generation)
	}
	return nil
}

func (g *dataGrant) checkGrow(m metaView, size uint64) error {
	v, err := g.volume(m)
	if err != nil {
		return err
	}
	if size > v.SizeBytes {
		return lagging("GROW %s to %d bytes: volume %s is %d bytes", g.open.Replica, size, v.Name, v.SizeBytes)
	}
	return nil
}

func (g *dataGrant) checkCut(m metaView, layer string) error {
	sid, epoch, ok := replica.ParseLayerName(layer)
	if !ok || epoch != g.open.Epoch {
		return denied("SNAPSHOT_CREATE %q on %s: not a layer name at epoch %d", layer, g.open.Replica, g.open.Epoch)
	}
	v, err := g.volume(m)
	if err != nil {
		return err
	}
	if !slices.Contains(v.PendingSnapshotIds, sid) {
		return lagging("SNAPSHOT_CREATE %q on %s: volume %s has no pending snapshot %s", layer, g.open.Replica, v.Name, sid)
	}
	return nil
}

func (g *dataGrant) checkLayer(m metaView, layer string) error {
	sid, _, ok := replica.ParseLayerName(layer)
	if !ok {
		return denied("layer %q of %s: not a snapshot layer", layer, g.open.Replica)
	}
	s, err := m.Snapshot(sid)
	if errors.Is(err, raftstore.ErrNotFound) {
		return lagging("layer %q of %s: snapshot %s not found", layer, g.open.Replica, sid)
	} else if err != nil {
		return err
	}
	if s.VolumeId != g.open.Volume {
		return denied("layer %q of %s: snapshot %s is of another volume", layer, g.open.Replica, sid)
	}
	return nil
}

func (g *dataGrant) checkDelete(m metaView, layer string) error {
	sid, epoch, ok := replica.ParseLayerName(layer)
	if !ok {
		return denied("SNAPSHOT_DELETE %q on %s: not a snapshot layer", layer, g.open.Replica)
	}
	s, err := m.Snapshot(sid)
	if errors.Is(err, raftstore.ErrNotFound) {
		return nil // the snapshot is gone: its layer is merged anyway
	} else if err != nil {
		return err
	}
	v, err := g.volume(m)
	if err != nil {
		return err
	}
	if s.VolumeId != v.Id {
		return denied("SNAPSHOT_DELETE %q on %s: snapshot %s is of another volume", layer, g.open.Replica, sid)
	}
	if strayLayer(s, v, g.open.Replica, epoch) == "" {
		return denied("SNAPSHOT_DELETE %q on %s: the metadata keeps this layer (snapshot %s)", layer, g.open.Replica, s.Name)
	}
	return nil
}
