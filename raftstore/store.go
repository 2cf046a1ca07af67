package raftstore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// Store is one server's member of the metadata Raft group: the Raft node,
// its FSM, and the leader's duties (cluster init, liveness, voter
// promotion). All exported methods are safe for concurrent use.
type Store struct {
	cfg    Config
	logger *slog.Logger
	fsm    *FSM
	raft   *raft.Raft
	trans  *raft.NetworkTransport
	logs   *raftboltdb.BoltStore

	hadState bool // Raft state existed when the store was opened

	identMu sync.Mutex
	ident   identity
	// joiningCluster is the cluster a store of none is joining
	// (JoiningCluster); guarded by identMu.
	joiningCluster string
	// refusedSaid is when a Raft connection of another cluster was last
	// logged (refusedRaftPeer); guarded by identMu.
	refusedSaid time.Time

	// leaderChanges counts the leader changes this server observed (a new
	// leader, or none, as Raft reports them); see LeaderChanges.
	leaderChanges atomic.Uint64
	// leaderGone is closed at the next leader change (LeaderGone);
	// guarded by leaderMu, nil until asked for.
	leaderMu   sync.Mutex
	leaderGone chan struct{}

	// leaderReady is set once this server, as leader, has applied every
	// entry of earlier terms; ConsistentRead requires it.
	leaderReady atomic.Bool

	// memberMu serialises membership decisions (count the voters, then
	// add one): two concurrent joins must not both see room for a voter.
	memberMu sync.Mutex
	// joinMu keeps a join (check, register, Raft member) and a removal
	// (record, Raft member) from interleaving: a join between a removal's
	// two steps would leave a registered server out of Raft.
	joinMu sync.Mutex

	// drainWait: volumes the drain leaves alone until then (a refused
	// step); touched only by the leader's repair loop.
	drainWait map[string]time.Time

	// lastSeen is the leader's memory of when each server last reported.
	seenMu   sync.Mutex
	lastSeen map[string]time.Time
	used     map[string]uint64 // data-directory bytes in use, as last reported

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool
	// closing is set once the store closes its transport: raft's errors
	// on the connections that closes are then not faults (hclogFor).
	closing atomic.Bool
}

// Open opens or creates the store in cfg.Dir and starts its Raft node. A
// new store has no cluster: call Bootstrap, or have the leader of an
// existing cluster Join it.
func Open(cfg Config) (*Store, error) {
	cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ident, err := loadIdentity(cfg.Dir, cfg.ID)
	if err != nil {
		return nil, err
	}
	s := &Store{cfg: cfg, logger: cfg.Logger.With("server", cfg.ID), ident: ident, lastSeen: map[string]time.Time{}, used: map[string]uint64{}, drainWait: map[string]time.Time{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if err := s.open(); err != nil {
		s.closeResources()
		return nil, err
	}
	if err := s.saveDataDirID(); err != nil {
		s.closeResources()
		return nil, err
	}
	return s, nil
}

func (s *Store) open() error {
	cfg := s.cfg
	hl := hclogFor(s.logger, &s.closing)
	if _, err := os.Stat(filepath.Join(cfg.Dir, raftDBFile)); s.ident.Member && errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s was a member of cluster %q but its Raft state (%s) is gone; refusing to start a new cluster from it",
			ErrCorrupt, cfg.Dir, s.ident.ClusterID, raftDBFile)
	}
	var err error
	s.fsm, err = OpenFSM(filepath.Join(cfg.Dir, metaDBFile), s.logger)
	if err != nil {
		return err
	}
	s.logs, err = raftboltdb.New(raftboltdb.Options{
		Path:        filepath.Join(cfg.Dir, raftDBFile),
		BoltOptions: &bolt.Options{Timeout: time.Second},
	})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return fmt.Errorf("raftstore: %s is locked by another process (is another stor-server using this data dir?)", filepath.Join(cfg.Dir, raftDBFile))
		}
		return fmt.Errorf("%w: open %s: %v", ErrCorrupt, filepath.Join(cfg.Dir, raftDBFile), err)
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(cfg.Dir, cfg.SnapshotRetain, hl)
	if err != nil {
		return fmt.Errorf("raftstore: snapshot store: %w", err)
	}
	s.hadState, err = raft.HasExistingState(s.logs, s.logs, snaps)
	if err != nil {
		return fmt.Errorf("%w: read raft state in %s: %v", ErrCorrupt, cfg.Dir, err)
	}
	if s.ident.Member && !s.hadState {
		return fmt.Errorf("%w: %s was a member of cluster %q but its Raft state is gone; refusing to start a new cluster from it",
			ErrCorrupt, cfg.Dir, s.ident.ClusterID)
	}
	// Raft state without membership: a join whose answer was not
	// recorded (a crash in between), or a server refused while the
	// leader replicated to it (ErrDataDirReplaced). It is not a member
	// until it joins again (Member, the server's join loop).
	if err := s.checkClusterID(); err != nil {
		return err
	}
	if err := s.restoreIfBehind(snaps); err != nil {
		return err
	}

	ln := cfg.RaftListener
	if ln == nil {
		ln, err = net.Listen("tcp", cfg.RaftBind)
		if err != nil {
			return fmt.Errorf("raftstore: raft listen: %w", err)
		}
	}
	adv := ln.Addr()
	if cfg.RaftAdvertise != "" {
		adv, err = resolveAdvertise(cfg.RaftAdvertise)
		if err != nil {
			ln.Close()
			return err
		}
	}
	s.trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: &streamLayer{Listener: ln, advertise: adv, dial: cfg.Dial, check: &clusterCheck{
			cluster: s.ClusterID, speaks: s.checksRaftHello, refused: s.refusedRaftPeer,
		}},
		MaxPool: 3, Timeout: 10 * time.Second, Logger: hl,
	})

	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.ID)
	rc.Logger = hl
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	rc.TrailingLogs = cfg.TrailingLogs
	rc.NoSnapshotRestoreOnStart = true // the FSM is durable; see doc.go
	notify := make(chan bool, 16)
	rc.NotifyCh = notify
	s.raft, err = raft.NewRaft(rc, s.fsm, s.logs, s.logs, snaps, newMemberGate(s.trans, s.Member, s.ctx.Done()))
	if err != nil {
		return fmt.Errorf("raftstore: start raft: %w", err)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.leadershipLoop(notify)
	}()
	s.observeLeaders()
	return nil
}

// observeLeaders counts the leader changes Raft reports (LeaderChanges)
// until the store closes. Observations are dropped rather than block Raft
// when the counter's goroutine lags, which only delays the count.
func (s *Store) observeLeaders() {
	ch := make(chan raft.Observation, 16)
	obs := raft.NewObserver(ch, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	s.raft.RegisterObserver(obs)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.raft.DeregisterObserver(obs)
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-ch:
				s.leaderChanges.Add(1)
				s.leaderMu.Lock()
				if s.leaderGone != nil {
					close(s.leaderGone)
					s.leaderGone = nil
				}
				s.leaderMu.Unlock()
			}
		}
	}()
}

// LeaderChanges is how many times this server saw the leader change
// (including to no leader) since it started.
func (s *Store) LeaderChanges() uint64 { return s.leaderChanges.Load() }

// LeaderGone returns a channel that is closed once this server sees the
// leader change (a new leader, or none): taken before Leader or
// LeaderAddress, it says when what they returned stopped being the
// leader. The observations come asynchronously, so a change made shortly
// before the call may still close it (while the leader read after it is
// current), and one dropped from a burst (observeLeaders) leaves it open
// until the next change seen.
func (s *Store) LeaderGone() <-chan struct{} {
	s.leaderMu.Lock()
	defer s.leaderMu.Unlock()
	if s.leaderGone == nil {
		s.leaderGone = make(chan struct{})
	}
	return s.leaderGone
}

// resolveAdvertise accepts host:port with a host name or an IP.
func resolveAdvertise(addr string) (net.Addr, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("raftstore: raft advertise address %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p > 65535 {
		return nil, fmt.Errorf("raftstore: raft advertise address %q: bad port", addr)
	}
	return advertiseAddr{host: host, port: port}, nil
}

// advertiseAddr is a net.Addr that keeps a host name unresolved, so a
// StatefulSet pod advertises its stable DNS name, not its changing IP.
type advertiseAddr struct{ host, port string }

func (a advertiseAddr) Network() string { return "tcp" }
func (a advertiseAddr) String() string  { return net.JoinHostPort(a.host, a.port) }

func (s *Store) checkClusterID() error {
	var fsmCluster string
	_ = s.fsm.View(func(r *Reader) error { fsmCluster = r.ClusterID(); return nil })
	switch {
	case s.ident.ClusterID != "" && fsmCluster != "" && s.ident.ClusterID != fsmCluster:
		return fmt.Errorf("%w: %s: identity says cluster %q, state says cluster %q",
			ErrForeignDataDir, s.cfg.Dir, s.ident.ClusterID, fsmCluster)
	case s.ident.ClusterID == "" && fsmCluster != "" && s.ident.Member:
		return s.markMember(fsmCluster)
	}
	return nil
}

func (s *Store) restoreIfBehind(snaps *raft.FileSnapshotStore) error {
	metas, err := snaps.List()
	if err != nil {
		return fmt.Errorf("raftstore: list snapshots: %w", err)
	}
	if len(metas) == 0 || metas[0].Index <= s.fsm.AppliedIndex() {
		return nil
	}
	s.logger.Warn("state machine is behind the latest snapshot; restoring it", "applied", s.fsm.AppliedIndex(), "snapshot", metas[0].Index)
	_, rc, err := snaps.Open(metas[0].ID)
	if err != nil {
		return fmt.Errorf("%w: open snapshot %s: %v", ErrCorrupt, metas[0].ID, err)
	}
	return s.fsm.Restore(rc)
}

// markMember records that this directory now belongs to a cluster member.
func (s *Store) markMember(clusterID string) error {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	if s.ident.Member && (clusterID == "" || s.ident.ClusterID == clusterID) {
		return nil
	}
	next := s.ident
	next.Member, next.unsaved = true, false
	if clusterID != "" {
		next.ClusterID = clusterID
	}
	if err := saveIdentity(s.cfg.Dir, next); err != nil {
		return err
	}
	s.ident = next
	return nil
}

// HadState reports whether the store had Raft state when it was opened (a
// restart), as opposed to a new, empty directory.
func (s *Store) HadState() bool { return s.hadState }

// saveDataDirID saves the data dir id loadIdentity made for an identity
// of an older version (if markMember has not saved it since), once the
// directory is accepted: a start refused leaves the directory as it was.
func (s *Store) saveDataDirID() error {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	if !s.ident.unsaved {
		return nil
	}
	next := s.ident
	next.unsaved = false
	if err := saveIdentity(s.cfg.Dir, next); err != nil {
		return err
	}
	s.ident = next
	return nil
}

// Member reports whether this server has bootstrapped or joined a
// cluster (a server that came back on a new data dir has not, until it
// joins afresh).
func (s *Store) Member() bool {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	return s.ident.Member
}

// DataDirID is the identity of this server's data directory, which it
// registers with (storpb.Server.data_dir_id).
func (s *Store) DataDirID() string {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	return s.ident.DataDirID
}

// ClusterID is the id of the cluster this store is a member of, or the
// one it is joining (JoiningCluster); "" if neither. The Raft transport
// hears only servers of that cluster (clusterCheck).
func (s *Store) ClusterID() string {
	if id := s.MemberOf(); id != "" {
		return id
	}
	s.identMu.Lock()
	joining := s.joiningCluster
	s.identMu.Unlock()
	if joining != "" {
		return joining
	}
	// A member that joined a cluster of an older version before it was
	// named: named by the log since.
	var named string
	_ = s.fsm.View(func(r *Reader) error { named = r.ClusterID(); return nil })
	return named
}

// MemberOf is the id of the cluster this store's data dir is of, "" if
// none yet.
func (s *Store) MemberOf() string {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	return s.ident.ClusterID
}

// JoiningCluster tells a store of no cluster which one it is about to
// join, before it asks to (the leader's Raft dials it while the join is
// in progress, and is heard only once the store knows its cluster). A
// store of a cluster keeps it.
func (s *Store) JoiningCluster(id string) {
	s.identMu.Lock()
	defer s.identMu.Unlock()
	s.joiningCluster = id
}

// checksRaftHello reports whether the server at a Raft address checks
// the hello of the connections it accepts (its record says so).
func (s *Store) checksRaftHello(addr raft.ServerAddress) bool {
	checks := false
	_ = s.fsm.View(func(r *Reader) error {
		srvs, err := r.Servers()
		for _, srv := range srvs {
			if srv.RaftAddress == string(addr) {
				checks = srv.RaftClusterCheck
			}
		}
		return err
	})
	return checks
}

// refusedRaftPeer logs a Raft connection of another cluster, at most
// every ten seconds (its dialer retries all along).
func (s *Store) refusedRaftPeer(remote net.Addr, theirs, ours string) {
	s.identMu.Lock()
	quiet := time.Since(s.refusedSaid) < 10*time.Second
	if !quiet {
		s.refusedSaid = time.Now()
	}
	s.identMu.Unlock()
	if quiet {
		return
	}
	if ours == "" {
		s.logger.Warn("a Raft peer dialed this server, which is of no cluster yet: refused (a server of another cluster whose peer had this address?)",
			"remote", remote.String(), "their_cluster", theirs)
		return
	}
	s.logger.Warn("a Raft peer of another cluster dialed this server: refused (a server whose peer had this address once: a reused IP or port)",
		"remote", remote.String(), "their_cluster", theirs, "cluster", ours)
}

// Bootstrap makes this server the single voter of a new cluster, naming
// it. It is an error on a store that already has Raft state: bootstrap
// happens once.
func (s *Store) Bootstrap() error {
	if s.hadState {
		return fmt.Errorf("%w: %s already holds Raft state; not bootstrapping again", ErrFailedPrecondition, s.cfg.Dir)
	}
	// The cluster is named here, not when its first leader records it
	// (opInitCluster, with this name), so that its Raft transport hears
	// no server of another cluster from the first.
	if err := s.markMember(uuid.NewString()); err != nil {
		return err
	}
	f := s.raft.BootstrapCluster(raft.Configuration{Servers: []raft.Server{{
		ID: raft.ServerID(s.cfg.ID), Address: s.trans.LocalAddr(), Suffrage: raft.Voter,
	}}})
	if err := f.Error(); err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
		return fmt.Errorf("raftstore: bootstrap: %w", err)
	}
	s.logger.Info("bootstrapped a new cluster")
	return nil
}

// Joined records that the leader of clusterID has admitted this server.
func (s *Store) Joined(clusterID string) error { return s.markMember(clusterID) }

// ID is this server's id.
func (s *Store) ID() string { return s.cfg.ID }

// RaftAddress is the address other servers reach this one's Raft at.
func (s *Store) RaftAddress() string { return string(s.trans.LocalAddr()) }

// IsLeader reports whether this server is the leader right now.
func (s *Store) IsLeader() bool { return s.raft.State() == raft.Leader }

// Leader returns the current leader's id and raft address as this server
// knows them ("" when unknown).
func (s *Store) Leader() (id, raftAddr string) {
	addr, lid := s.raft.LeaderWithID()
	return string(lid), string(addr)
}

// LeaderAddress returns the leader's control address from the FSM's server
// registry, or ErrNoLeader.
func (s *Store) LeaderAddress() (id, address string, err error) {
	id, _ = s.Leader()
	if id == "" {
		return "", "", ErrNoLeader
	}
	err = s.fsm.View(func(r *Reader) error {
		srv, err := r.Server(id)
		if err != nil {
			return err
		}
		address = srv.Address
		return nil
	})
	if err != nil {
		return id, "", fmt.Errorf("%w: leader %q is not registered yet: %v", ErrNoLeader, id, err)
	}
	return id, address, nil
}

// AppliedIndex is the index of the last entry this server's FSM applied.
func (s *Store) AppliedIndex() uint64 { return s.fsm.AppliedIndex() }

// Changed is signalled after this server's state machine changes
// (coalesced; for one consumer).
func (s *Store) Changed() <-chan struct{} { return s.fsm.Changed() }

// View reads the local FSM state (possibly stale on a follower).
func (s *Store) View(fn func(r *Reader) error) error { return s.fsm.View(fn) }

// Watch streams committed changes to one volume (see FSM.Watch).
func (s *Store) Watch(volumeID string) (<-chan VolumeEvent, func()) { return s.fsm.Watch(volumeID) }

// ConsistentRead returns nil when a read of the local FSM that starts now
// is linearizable: this server is the leader, has applied every entry of
// earlier terms, and a quorum still follows it.
func (s *Store) ConsistentRead(ctx context.Context) error {
	if !s.IsLeader() {
		return ErrNotLeader
	}
	if !s.leaderReady.Load() {
		return fmt.Errorf("%w: new leader is still catching up", ErrNoLeader)
	}
	if err := waitFuture(ctx, s.raft.VerifyLeader()); err != nil {
		return s.raftErr(err)
	}
	return nil
}

// waitFuture waits for a raft future or the context.
func waitFuture(ctx context.Context, f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *Store) raftErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return ErrNotLeader
	case errors.Is(err, raft.ErrLeadershipLost):
		return fmt.Errorf("%w: leadership lost before the change was known to commit", ErrNoLeader)
	case errors.Is(err, raft.ErrRaftShutdown):
		return ErrClosed
	case errors.Is(err, raft.ErrEnqueueTimeout):
		return fmt.Errorf("%w: %v", ErrNoLeader, err)
	}
	return err
}

// propose commits a command and returns the FSM's answer.
func (s *Store) propose(ctx context.Context, c command) (proto.Message, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	if !s.IsLeader() {
		return nil, ErrNotLeader
	}
	c.At = s.cfg.Now().UnixNano()
	data, err := c.encode()
	if err != nil {
		return nil, err
	}
	timeout := s.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
		if timeout <= 0 {
			return nil, context.DeadlineExceeded
		}
	}
	start := time.Now()
	f := s.raft.Apply(data, timeout)
	if err := waitFuture(ctx, f); err != nil {
		return nil, s.raftErr(err)
	}
	if s.cfg.ObserveApply != nil {
		s.cfg.ObserveApply(time.Since(start))
	}
	res, ok := f.Response().(result)
	if !ok {
		return nil, fmt.Errorf("%w: %v entry answered %T", ErrCorrupt, c.Op, f.Response())
	}
	return res.msg, res.err
}

// ---------------------------------------------------------------- volumes

// CreateVolume creates a volume (idempotent by name). The size is rounded
// up to BlockSize; placement happens in the FSM.
func (s *Store) CreateVolume(ctx context.Context, req *storpb.CreateVolumeRequest) (*storpb.Volume, error) {
	m, err := s.propose(ctx, command{Op: opCreateVolume, ID: uuid.NewString(), Body: req})
	return asVolume(m, err)
}

// DeleteVolume deletes a volume; ErrNotFound if there is none. A volume
// with snapshots is kept for them (volumestate.go): it is returned as
// retained, in state DELETED; a removed volume returns nil.
func (s *Store) DeleteVolume(ctx context.Context, ref *storpb.VolumeRef) (retained *storpb.Volume, err error) {
	v, err := asVolume(s.propose(ctx, command{Op: opDeleteVolume, Body: ref}))
	if err != nil || !IsDeleted(v) {
		return nil, err
	}
	return v, nil
}

// ExpandVolume grows a volume.
func (s *Store) ExpandVolume(ctx context.Context, req *storpb.ExpandVolumeRequest) (*storpb.Volume, error) {
	return asVolume(s.propose(ctx, command{Op: opExpandVolume, Body: req}))
}

// AttachVolume attaches a volume to a node at a new epoch.
func (s *Store) AttachVolume(ctx context.Context, req *storpb.AttachVolumeRequest) (*storpb.Volume, error) {
	if err := CheckNodeID("attach volume: node id", req.GetNodeId()); err != nil {
		return nil, err // before it costs a log entry; apply checks again
	}
	return asVolume(s.propose(ctx, command{Op: opAttachVolume, Body: req}))
}

// DetachVolume clears a volume's attachment.
func (s *Store) DetachVolume(ctx context.Context, req *storpb.DetachVolumeRequest) (*storpb.Volume, error) {
	return asVolume(s.propose(ctx, command{Op: opDetachVolume, Body: req}))
}

// SetReplicaState records a data-path report about one replica.
func (s *Store) SetReplicaState(ctx context.Context, req *storpb.SetReplicaStateRequest) (*storpb.Volume, error) {
	return asVolume(s.propose(ctx, command{Op: opSetReplicaState, Body: req}))
}

// ReplaceReplica removes and/or adds a replica (see storpb.ReplaceReplicaRequest).
func (s *Store) ReplaceReplica(ctx context.Context, req *storpb.ReplaceReplicaRequest) (*storpb.Volume, error) {
	v, _, err := s.ReplaceReplicaAdded(ctx, req)
	return v, err
}

// ReplaceReplicaAdded is ReplaceReplica that also returns the id of the
// replica it added ("" for a removal only).
func (s *Store) ReplaceReplicaAdded(ctx context.Context, req *storpb.ReplaceReplicaRequest) (*storpb.Volume, string, error) {
	id := uuid.NewString()
	req = proto.Clone(req).(*storpb.ReplaceReplicaRequest)
	req.LostReplicaFreesItsServer = s.everyServerNamesItsDataDir()
	v, err := asVolume(s.propose(ctx, command{Op: opReplaceReplica, ID: id, Body: req}))
	if err != nil || req.RemoveOnly {
		id = ""
	}
	return v, id, err
}

// CreateSnapshot records a snapshot of a volume (idempotent by name); the
// data path cuts it (see snapshot.go).
func (s *Store) CreateSnapshot(ctx context.Context, req *storpb.CreateSnapshotRequest) (*storpb.Snapshot, error) {
	m, err := s.propose(ctx, command{Op: opCreateSnapshot, ID: uuid.NewString(), Body: req})
	if err != nil {
		return nil, err
	}
	return m.(*storpb.Snapshot), nil
}

// DeleteSnapshot deletes a snapshot; ErrNotFound if there is none.
func (s *Store) DeleteSnapshot(ctx context.Context, ref *storpb.SnapshotRef) error {
	_, err := s.propose(ctx, command{Op: opDeleteSnapshot, Body: ref})
	return err
}

// RecordSnapshotCut records cuts (and misses) the data path made.
func (s *Store) RecordSnapshotCut(ctx context.Context, req *storpb.RecordSnapshotCutRequest) (*storpb.Snapshot, error) {
	m, err := s.propose(ctx, command{Op: opRecordCut, Body: req})
	if err != nil {
		return nil, err
	}
	return m.(*storpb.Snapshot), nil
}

// RecordCloneCopied records that a clone's replica holds its copy.
func (s *Store) RecordCloneCopied(ctx context.Context, req *storpb.RecordCloneCopiedRequest) (*storpb.Volume, error) {
	return asVolume(s.propose(ctx, command{Op: opRecordCloneCopy, Body: req}))
}

func asVolume(m proto.Message, err error) (*storpb.Volume, error) {
	if err != nil {
		return nil, err
	}
	return m.(*storpb.Volume), nil
}

// ------------------------------------------------------------- membership

// Join admits a server (leader only): registers it in the FSM, then adds
// it to the Raft configuration, as a voter while there are fewer than
// MaxVoters voters. Joining again is harmless and updates the addresses.
func (s *Store) Join(ctx context.Context, srv *storpb.Server) (clusterID string, voter bool, err error) {
	if srv == nil || srv.Id == "" || srv.Address == "" || srv.RaftAddress == "" {
		return "", false, fmt.Errorf("%w: join needs the server's id, address and raft address", ErrInvalidArgument)
	}
	if err := checkServerIDs(srv); err != nil {
		return "", false, err
	}
	s.joinMu.Lock()
	defer s.joinMu.Unlock()
	if err := s.ConsistentRead(ctx); err != nil {
		return "", false, err
	}
	if err := s.checkDataDir(srv); err != nil {
		return "", false, err
	}
	if _, err := s.propose(ctx, command{Op: opRegisterServer, Body: srv}); err != nil {
		return "", false, err
	}
	voter, err = s.ensureRaftMember(ctx, srv.Id, srv.RaftAddress)
	if err != nil {
		return "", false, err
	}
	s.markSeen(srv.Id)
	s.markUsed(srv.Id, srv.UsedBytes)
	_ = s.fsm.View(func(r *Reader) error { clusterID = r.ClusterID(); return nil })
	s.logger.Info("server joined", "joined", srv.Id, "raft_address", srv.RaftAddress, "voter", voter)
	return clusterID, voter, nil
}

// ensureRaftMember adds the server to the Raft configuration, or updates
// its address, keeping its suffrage.
func (s *Store) ensureRaftMember(ctx context.Context, id, raftAddr string) (voter bool, err error) {
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	conf, err := s.configuration()
	if err != nil {
		return false, err
	}
	voters := 0
	var existing *raft.Server
	for i, m := range conf.Servers {
		if m.Suffrage == raft.Voter {
			voters++
		}
		if string(m.ID) == id {
			existing = &conf.Servers[i]
		}
	}
	timeout := s.cfg.ApplyTimeout
	switch {
	case existing != nil && string(existing.Address) == raftAddr:
		return existing.Suffrage == raft.Voter, nil
	case existing != nil && existing.Suffrage == raft.Voter, existing == nil && voters < s.cfg.MaxVoters:
		return true, s.raftErr(waitFuture(ctx, s.raft.AddVoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, timeout)))
	default:
		return false, s.raftErr(waitFuture(ctx, s.raft.AddNonvoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, timeout)))
	}
}

func (s *Store) configuration() (raft.Configuration, error) {
	f := s.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return raft.Configuration{}, s.raftErr(err)
	}
	return f.Configuration(), nil
}

// Leave removes a server from the cluster (leader only): from the FSM (its
// replicas become faulty) and from the Raft configuration.
func (s *Store) Leave(ctx context.Context, id string) error {
	if err := CheckServerID("leave: server id", id); err != nil {
		return err
	}
	s.joinMu.Lock()
	defer s.joinMu.Unlock()
	conf, err := s.configuration()
	if err != nil {
		return err
	}
	inRaft := slices.ContainsFunc(conf.Servers, func(m raft.Server) bool { return string(m.ID) == id })
	_, err = s.propose(ctx, command{Op: opRemoveServer, ID: id})
	if err != nil && !(errors.Is(err, ErrNotFound) && inRaft) {
		return err
	}
	if inRaft {
		if err := s.raftErr(waitFuture(ctx, s.raft.RemoveServer(raft.ServerID(id), 0, s.cfg.ApplyTimeout))); err != nil {
			return err
		}
	}
	s.seenMu.Lock()
	delete(s.lastSeen, id)
	s.seenMu.Unlock()
	s.logger.Info("server left", "left", id)
	return nil
}

// Heartbeat records that a server is alive (leader only). It marks a down
// server up again and commits changed addresses, zone, labels or capacity.
func (s *Store) Heartbeat(ctx context.Context, in *storpb.Server) error {
	if in == nil || in.Id == "" {
		return fmt.Errorf("%w: heartbeat needs a server id", ErrInvalidArgument)
	}
	if err := checkServerIDs(in); err != nil {
		return err
	}
	if !s.IsLeader() {
		return ErrNotLeader
	}
	var cur *storpb.Server
	err := s.fsm.View(func(r *Reader) error {
		var err error
		cur, err = r.Server(in.Id)
		return err
	})
	if err != nil {
		return err // ErrNotFound: the server has to join first
	}
	if err := dataDirMatches(cur, in); err != nil {
		return err // not seen: its replicas are not on this data dir
	}
	s.markSeen(in.Id)
	s.markUsed(in.Id, in.UsedBytes)
	if cur.State == storpb.ServerState_SERVER_STATE_DOWN {
		s.logger.Info("server is back", "back", in.Id)
		up := &storpb.Server{Id: in.Id, State: storpb.ServerState_SERVER_STATE_UP, LastSeenUnixNano: s.cfg.Now().UnixNano()}
		if _, err := s.propose(ctx, command{Op: opSetServerState, Body: up}); err != nil {
			return err
		}
	}
	if in.Address != "" && in.RaftAddress != "" && serverInfoChanged(cur, in) {
		s.joinMu.Lock()
		defer s.joinMu.Unlock()
		// Again under the lock: not removed since (ErrNotFound).
		if err := s.fsm.View(func(r *Reader) error {
			cur, err := r.Server(in.Id)
			if err != nil {
				return err
			}
			return dataDirMatches(cur, in)
		}); err != nil {
			return err
		}
		if _, err := s.propose(ctx, command{Op: opRegisterServer, Body: in}); err != nil {
			return err
		}
		if in.RaftAddress != cur.RaftAddress {
			if _, err := s.ensureRaftMember(ctx, in.Id, in.RaftAddress); err != nil {
				return err
			}
		}
	}
	return nil
}

// everyServerNamesItsDataDir reports whether every server's record has a
// data dir id: every server has registered with a version that sends one,
// and applies what came with it (ReplaceReplicaRequest's
// lost_replica_frees_its_server).
func (s *Store) everyServerNamesItsDataDir() bool {
	all := false
	_ = s.fsm.View(func(r *Reader) error {
		srvs, err := r.Servers()
		if err != nil {
			return err
		}
		all = len(srvs) > 0 && !slices.ContainsFunc(srvs, func(x *storpb.Server) bool { return x.DataDirId == "" })
		return nil
	})
	return all
}

// ErrDataDirReplaced is returned (wrapping ErrFailedPrecondition) to a
// server that joins or reports on another data dir than the one the
// cluster knows it on (dataDirMatches).
var ErrDataDirReplaced = fmt.Errorf("%w: server came back on another data dir", ErrFailedPrecondition)

// checkDataDir refuses a join of a server the cluster knows on another
// data dir (dataDirMatches).
func (s *Store) checkDataDir(in *storpb.Server) error {
	return s.fsm.View(func(r *Reader) error {
		cur, err := r.Server(in.Id)
		if errors.Is(err, ErrNotFound) {
			return nil // a new member, or one removed: it joins afresh
		}
		if err != nil {
			return err
		}
		return dataDirMatches(cur, in)
	})
}

// dataDirMatches refuses a server whose data dir is not the one its
// record names: the dir was wiped, replaced, or is not mounted, and holds
// none of the replicas the cluster places on the server. Admitted, it
// would make them again, empty, for replicas the cluster has as healthy.
// Refused, it stays out (down, its replicas faulty and in time replaced)
// until the old dir is back or an operator removes it, after which it
// joins afresh. A record or a server of a version before data dir ids
// ("") is not checked.
func dataDirMatches(cur, in *storpb.Server) error {
	if cur.DataDirId == "" || in.DataDirId == "" || cur.DataDirId == in.DataDirId {
		return nil
	}
	return fmt.Errorf("%w: the cluster knows server %s on data dir %s, not on this one (%s): the replicas it places on the server are not here; "+
		"if the server's disk is not mounted, mount it and restart the server; otherwise remove the server (stor-ctl server remove %s): "+
		"it then joins afresh on this dir, and its replicas are rebuilt from the others",
		ErrDataDirReplaced, in.Id, cur.DataDirId, in.DataDirId, in.Id)
}

func serverInfoChanged(cur, in *storpb.Server) bool {
	return cur.Address != in.Address || cur.RaftAddress != in.RaftAddress || cur.DataAddress != in.DataAddress ||
		cur.Zone != in.Zone || cur.CapacityBytes != in.CapacityBytes || !mapsEqual(cur.Labels, in.Labels) ||
		cur.KubernetesNode != in.KubernetesNode || (in.DataDirId != "" && in.DataDirId != cur.DataDirId) ||
		cur.RaftClusterCheck != in.RaftClusterCheck // upgraded, or downgraded
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if bv, ok := b[k]; !ok || bv != v {
			return false
		}
	}
	return true
}

func (s *Store) markSeen(id string) {
	s.seenMu.Lock()
	s.lastSeen[id] = s.cfg.Now()
	s.seenMu.Unlock()
}

// LastSeen returns when the leader last heard from a server (zero if it
// has not, or this server is not the leader).
func (s *Store) LastSeen(id string) time.Time {
	s.seenMu.Lock()
	defer s.seenMu.Unlock()
	return s.lastSeen[id]
}

// markUsed records the data-directory bytes in use a server reported
// (0: it did not say; the last figure is kept).
func (s *Store) markUsed(id string, used uint64) {
	if used == 0 {
		return
	}
	s.seenMu.Lock()
	s.used[id] = used
	s.seenMu.Unlock()
}

// UsedBytes returns the data-directory bytes in use a server last
// reported (0 if it has not, or this server is not the leader).
func (s *Store) UsedBytes(id string) uint64 {
	s.seenMu.Lock()
	defer s.seenMu.Unlock()
	return s.used[id]
}

// ----------------------------------------------------------------- status

// Status is this server's own view of the cluster.
type Status struct {
	ClusterID, ServerID, RaftState, LeaderID string
	Members                                  []raft.Server
	Term, LastIndex, CommitIndex, Applied    uint64
}

// Status returns this server's view without asking the leader.
func (s *Store) Status() Status {
	st := Status{ServerID: s.cfg.ID, RaftState: s.raft.State().String()}
	st.LeaderID, _ = s.Leader()
	stats := s.raft.Stats()
	st.Term, _ = strconv.ParseUint(stats["term"], 10, 64)
	st.LastIndex = s.raft.LastIndex()
	st.CommitIndex, _ = strconv.ParseUint(stats["commit_index"], 10, 64)
	st.Applied = s.fsm.AppliedIndex()
	if conf, err := s.configuration(); err == nil {
		st.Members = conf.Servers
	}
	_ = s.fsm.View(func(r *Reader) error { st.ClusterID = r.ClusterID(); return nil })
	return st
}

// ---------------------------------------------------------------- closing

// TransferLeadership hands leadership to another voter if this server
// leads; used before a graceful shutdown.
func (s *Store) TransferLeadership(ctx context.Context) error {
	if !s.IsLeader() {
		return nil
	}
	conf, err := s.configuration()
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(conf.Servers, func(m raft.Server) bool {
		return m.Suffrage == raft.Voter && string(m.ID) != s.cfg.ID
	}) {
		return nil // no other voter to hand over to
	}
	return s.raftErr(waitFuture(ctx, s.raft.LeadershipTransfer()))
}

// Close stops the Raft node and closes the files. It does not hand off
// leadership (see TransferLeadership); after Close every method fails with
// ErrClosed or a raft shutdown error.
func (s *Store) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	s.closing.Store(true) // raft's Shutdown closes the transport too
	s.cancel()
	var err error
	if s.raft != nil {
		err = s.raft.Shutdown().Error()
	}
	s.wg.Wait()
	return errors.Join(err, s.closeResources())
}

func (s *Store) closeResources() error {
	var errs []error
	s.closing.Store(true)
	if s.trans != nil {
		// The connections this store dialed (raft keeps a pool of them)
		// and those it accepted (streamLayer.Close): its peers' ends
		// would otherwise read on.
		s.trans.CloseStreams()
		errs = append(errs, s.trans.Close())
	}
	if s.logs != nil {
		errs = append(errs, s.logs.Close())
	}
	if s.fsm != nil {
		errs = append(errs, s.fsm.Close())
	}
	return errors.Join(errs...)
}
