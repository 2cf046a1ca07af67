package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

var (
	// ErrFenced: a newer attach exists; this engine may never write again.
	ErrFenced = errors.New("engine: fenced by a newer attach")
	// ErrIO: the volume cannot complete the request (no healthy replica
	// could serve it).
	ErrIO = errors.New("engine: i/o error")
	// ErrClosed: the engine was closed.
	ErrClosed = errors.New("engine: closed")
)

// ReplicaConn is the engine's view of one opened replica. The replica data
// protocol client (replica/wire) implements it over the network; tests may
// use a replica in the same process.
type ReplicaConn interface {
	ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error
	WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error
	WriteZeroes(ctx context.Context, o replica.Op, off, n int64) error
	Trim(ctx context.Context, o replica.Op, off, n int64) error
	Flush(ctx context.Context, o replica.Op) error
	Grow(ctx context.Context, o replica.Op, size uint64) error
	DirtyRegions(ctx context.Context, o replica.Op) ([]replica.Extent, error)
	Extents(ctx context.Context, o replica.Op, snapshotID string, from int64, limit int) ([]replica.Extent, error)
	WrittenSince(ctx context.Context, o replica.Op, generation uint64) ([]replica.Extent, error)
	BeginRebuild(ctx context.Context, o replica.Op) error
	RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error
	EndRebuild(ctx context.Context, o replica.Op) error
	Close(ctx context.Context) error
}

// Connector opens replica open.Replica on the server at dataAddr at epoch
// open.Epoch, stating the volume, node and purpose the server authorises
// the open by (wire.OpenRequest).
type Connector func(ctx context.Context, dataAddr string, open wire.OpenRequest) (ReplicaConn, error)

// ControlPlane is what the engine needs of the cluster's control API; the
// generated gRPC clients satisfy it.
type ControlPlane struct {
	Volumes storpb.VolumeServiceClient
	Cluster storpb.ClusterServiceClient
	// Snapshots is how the engine records the snapshots it cuts; without
	// it, snapshots of the attached volume stay pending (snapshot.go).
	Snapshots storpb.SnapshotServiceClient
}

// Config configures Open.
type Config struct {
	// Volume names the volume (by name; or by id with VolumeIsID).
	Volume     string
	VolumeIsID bool
	// NodeID is where the volume is attached (recorded in Raft).
	NodeID string
	// Takeover attaches even when the volume is attached to another node;
	// the new epoch fences the previous holder.
	Takeover bool
	// RequireAttached opens only a volume already attached to NodeID (the
	// CSI node: only ControllerPublish creates an attachment); otherwise
	// Open fails with the control plane's FAILED_PRECONDITION.
	RequireAttached bool
	// ReadOnly attaches read-only: writes fail with replica.ErrInvalid.
	ReadOnly bool
	// LocalServerID is the server on this node, if any: reads prefer its
	// replica.
	LocalServerID string
	// LocalReaders open short-circuit reads of replicas on servers of
	// this host (replica/localread; localread.go): reads prefer those
	// replicas and read them directly while they can.
	LocalReaders []LocalReader
	// OnAttached, if set, is called with the new epoch as soon as the
	// control plane has committed Open's attach, before Open does anything
	// else that may fail: a caller that records the epoch it attached at
	// (internal/attach) then records it even when Open fails after it.
	OnAttached func(epoch uint64)
	// Control reaches the cluster; required.
	Control ControlPlane
	// Connect opens replicas; required (wire.Connector for the network).
	Connect Connector
	// IOTimeout bounds one request to one replica; a replica that does not
	// answer in time is treated as failed. Default 10s.
	IOTimeout time.Duration
	// FaultTimeout bounds how long a write waits for the control plane to
	// commit a failed replica as faulty (through leader elections). If it
	// cannot, the engine stops serving (every call fails with ErrIO): it
	// never serves from a replica set it cannot vouch for. Default 2m.
	FaultTimeout time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
	// RebuildChunkBytes and RebuildInFlight shape the rebuilds the engine
	// drives (RebuildPlan.ChunkBytes and InFlight); 0 is the default.
	RebuildChunkBytes int64
	RebuildInFlight   int
	// RebuildRelay copies every chunk of a rebuild through the engine
	// (read from the source, written to the target; RebuildPlan.Relay)
	// even where the target's server could read it from the source
	// itself. Default false: the target copies (REBUILD_COPY), and the
	// engine relays only what the target could not. For comparisons.
	RebuildRelay bool

	// UnsafeUnorderedRebuild is for fault tests only (the jepsen harness's
	// broken mode "rebuild overwrites tracked writes"): it lets rebuild
	// copies skip the ordering against writes in flight, which
	// reintroduces the bug of ISSUE13 C (a rebuild copying a block older
	// than an acknowledged write over it). Default false; never set it
	// anywhere else.
	UnsafeUnorderedRebuild bool
	// UnsafeStaleLocalReads is for fault tests only (the jepsen harness's
	// broken mode "stale-local-reads"): a short-circuit read uses what it
	// read even when its view went stale, and keeps the view, which
	// reintroduces reading a replica's files after the server stopped
	// vouching for them (a snapshot cut, a newer epoch). Default false.
	UnsafeStaleLocalReads bool
}

// Validate reports the first problem with the configuration.
func (c *Config) Validate() error {
	switch {
	case c.Volume == "":
		return errors.New("engine: config: Volume is required")
	case c.NodeID == "":
		return errors.New("engine: config: NodeID is required")
	case c.Control.Volumes == nil || c.Control.Cluster == nil:
		return errors.New("engine: config: Control clients are required")
	case c.Connect == nil:
		return errors.New("engine: config: Connect is required")
	}
	return nil
}

// member is one replica the engine writes to. It is never modified once
// in the write set; a state change replaces it, keeping its conn and its
// incarnation. An incarnation is one connection's stay in the write set,
// from its join to its leaving (the replica recorded faulty or removed);
// a replica that leaves and rejoins is a new incarnation, on a new
// connection.
type member struct {
	info        *storpb.Replica
	conn        ReplicaConn
	local       *localRead // nil unless its server is on this host (localread.go)
	incarnation uint64
}

// Engine is an open volume. See the package documentation for its rules.
type Engine struct {
	cfg    Config
	logger *slog.Logger
	id     string // volume id
	name   string
	epoch  uint64
	// purpose is what the engine's OPENs state: PurposeAttach, or
	// PurposeSnapshotCut for CutDetached's engine.
	purpose wire.Purpose
	// localServers are the servers on this host: cfg.LocalServerID and
	// those of cfg.LocalReaders. Set by newEngine, then read only.
	localServers map[string]bool

	size   atomic.Uint64
	fenced atomic.Bool
	closed atomic.Bool
	broken atomic.Bool // a replica failure could not be committed: stop serving

	// rebuildCopied counts the bytes this engine's rebuilds copied since
	// it opened; rebuildLeft the bytes its running rebuilds have left to
	// copy, as they last reported (RebuildProgress).
	rebuildCopied atomic.Int64
	rebuildLeft   atomic.Int64
	// localReads counts the reads served directly (localread.go).
	localReads atomic.Int64

	// overlaps holds the writes, reads and rebuild copies under way: it
	// keeps overlapping writes in one order on every replica, keeps reads
	// and rebuild copies off blocks with a write in flight, and a flush
	// waits for the writes that began before it (overlap.go, flushOrdered).
	overlaps overlaps

	// flushTurn serialises the engine's flushes on every path (Flush,
	// Close, reconcile, a rebuild's flushes of its target): a token in it
	// is a flush under way. See flushOrdered.
	flushTurn chan struct{}

	// quiesce is held shared by every write from beginWrite to endWrite
	// and exclusively by a snapshot cut (snapshot.go).
	quiesce sync.RWMutex

	// mu guards the write set and the generation. Requests copy the set
	// under mu and release it before doing I/O.
	mu         sync.Mutex
	members    map[string]*member // replica id -> opened replica (healthy or rebuilding)
	rebuilding map[string]bool    // replica ids with a rebuild goroutine running
	generation uint64
	joins      uint64                    // incarnations made (member.incarnation)
	servers    map[string]*storpb.Server // server id -> server, for data addresses
	last       *storpb.Volume            // the latest committed state seen on the watch
	cutting    bool                      // a snapshot cut goroutine runs (snapshot.go)
	cutAgain   bool                      // the volume changed while it ran: look again
	cutPoints  map[string][]string       // snapshot id -> replicas cut at the point this engine fixed (snapshot.go)
	// leftAt is, per replica that left the write set, its generation in
	// the view it left in. An open from a view no newer (a watch event
	// older than the leaving, retryJoins' last view) would state the old
	// incarnation again, which its server does not order after what the
	// old connection still carries (wire's doc, "Incarnations").
	leftAt map[string]uint64
	// joinFaults paces, per rebuilding replica, recording it faulty when
	// its open fails on its own failure (follow.go, addNewReplicas).
	joinFaults map[string]*joinFault

	// faultMu serialises reports to the control plane so one failing
	// replica is reported once.
	faultMu sync.Mutex

	// growMu orders growing the replicas (grow) with adding a replica to
	// the write set (joinGrown), so every member is as large as size.
	growMu sync.Mutex

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// Open attaches the volume at a new epoch, opens its replicas, reconciles
// the regions an unclean stop may have left different, and starts
// following the volume's changes. The returned engine serves I/O.
func Open(ctx context.Context, cfg Config) (*Engine, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	mode := storpb.AccessMode_ACCESS_MODE_READ_WRITE
	if cfg.ReadOnly {
		mode = storpb.AccessMode_ACCESS_MODE_READ_ONLY
	}
	att, err := cfg.Control.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{
		Volume: cfg.ref(), NodeId: cfg.NodeID, Mode: mode, Takeover: cfg.Takeover, RequireAttached: cfg.RequireAttached,
	})
	if err != nil {
		return nil, fmt.Errorf("engine: attach %s: %w", cfg.Volume, err)
	}
	v := att.Volume
	if cfg.OnAttached != nil {
		cfg.OnAttached(v.Epoch)
	}
	e := newEngine(cfg, v)
	if err := e.refreshServers(ctx); err != nil {
		e.abort()
		return nil, err
	}
	if err := e.openReplicas(ctx, v); err != nil {
		e.abort()
		return nil, err
	}
	// A volume expanded while detached has replicas smaller than its
	// committed size (only an engine grows them): grow them before any
	// I/O, the reconcile's included.
	if err := e.grow(ctx, v.SizeBytes); err != nil {
		e.abort()
		return nil, err
	}
	if err := e.reconcile(ctx); err != nil {
		e.abort()
		return nil, err
	}
	// From here on the watch goroutine shares the write set: use e.mu.
	e.logger.Info("volume open", "replicas", len(e.members), "size", v.SizeBytes, "generation", e.generation)
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.follow()
	}()
	e.startRebuilds()
	return e, nil
}

// withDefaults validates c and returns it with its defaults filled in.
func (c Config) withDefaults() (Config, error) {
	if err := c.Validate(); err != nil {
		return c, err
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = 10 * time.Second
	}
	if c.FaultTimeout == 0 {
		c.FaultTimeout = 2 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// ref names the volume c opens.
func (c *Config) ref() *storpb.VolumeRef {
	if c.VolumeIsID {
		return &storpb.VolumeRef{Id: c.Volume}
	}
	return &storpb.VolumeRef{Name: c.Volume}
}

// newEngine returns an engine for v at v's epoch with no replica opened.
func newEngine(cfg Config, v *storpb.Volume) *Engine {
	e := &Engine{
		cfg: cfg, id: v.Id, name: v.Name, epoch: v.Epoch, purpose: wire.PurposeAttach,
		logger:  cfg.Logger.With("volume", v.Name, "volume_id", v.Id, "epoch", v.Epoch),
		members: map[string]*member{}, rebuilding: map[string]bool{}, leftAt: map[string]uint64{}, joinFaults: map[string]*joinFault{},
		generation: v.Generation,
		flushTurn:  make(chan struct{}, 1),
	}
	e.size.Store(v.SizeBytes)
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.localServers = map[string]bool{}
	if cfg.LocalServerID != "" {
		e.localServers[cfg.LocalServerID] = true
	}
	for _, lr := range cfg.LocalReaders {
		e.localServers[lr.ServerID()] = true
	}
	return e
}

// abort releases what a failed Open acquired. The attachment stays: the
// caller may retry Open with Takeover, or detach.
func (e *Engine) abort() {
	e.closed.Store(true)
	e.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.IOTimeout)
	defer cancel()
	for _, m := range e.members {
		m.local.close()
		m.conn.Close(ctx)
	}
}

func (e *Engine) refreshServers(ctx context.Context) error {
	resp, err := e.cfg.Control.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		return fmt.Errorf("engine: list servers: %w", err)
	}
	servers := map[string]*storpb.Server{}
	for _, s := range resp.Servers {
		servers[s.Id] = s
	}
	e.mu.Lock()
	e.servers = servers
	e.mu.Unlock()
	return nil
}

// openReplicas opens every healthy and rebuilding replica in parallel. A
// healthy replica that cannot be opened is reported faulty; Open fails only
// if no healthy replica opens.
func (e *Engine) openReplicas(ctx context.Context, v *storpb.Volume) error {
	type opened struct {
		r    *storpb.Replica
		conn ReplicaConn
		err  error
	}
	var wanted []*storpb.Replica
	for _, r := range v.Replicas {
		if r.State != storpb.ReplicaState_REPLICA_STATE_FAULTY {
			wanted = append(wanted, r)
		}
	}
	results := make(chan opened, len(wanted))
	for _, r := range wanted {
		go func() {
			conn, err := e.connect(ctx, r)
			results <- opened{r, conn, err}
		}()
	}
	var failed []opened
	for range wanted {
		o := <-results
		if o.err != nil {
			if errors.Is(o.err, replica.ErrStaleEpoch) {
				e.fenced.Store(true)
			}
			failed = append(failed, o)
			continue
		}
		e.joins++
		e.members[o.r.Id] = &member{info: o.r, conn: o.conn, local: e.newLocalRead(o.r.ServerId), incarnation: e.joins}
	}
	if e.fenced.Load() {
		return fmt.Errorf("engine: open %s: %w", e.name, ErrFenced)
	}
	if e.healthyCount() == 0 {
		return fmt.Errorf("%w: volume %s: no healthy replica could be opened (%d failed: %v)", ErrIO, e.name, len(failed), firstErr(failed, func(o opened) error { return o.err }))
	}
	for _, o := range failed {
		e.logger.Warn("replica did not open", "replica", o.r.Id, "server", o.r.ServerId, "err", o.err)
		if err := e.markFaulty(ctx, nil, o.r.Id, fmt.Sprintf("open failed: %v", o.err)); err != nil {
			return err
		}
	}
	return nil
}

func firstErr[T any](xs []T, f func(T) error) error {
	for _, x := range xs {
		if err := f(x); err != nil {
			return err
		}
	}
	return nil
}

func (e *Engine) connect(ctx context.Context, r *storpb.Replica) (ReplicaConn, error) {
	e.mu.Lock()
	srv := e.servers[r.ServerId]
	e.mu.Unlock()
	if srv == nil || srv.DataAddress == "" {
		return nil, fmt.Errorf("server %q of replica %q has no data address", r.ServerId, r.Id)
	}
	ctx, cancel := context.WithTimeout(ctx, e.cfg.IOTimeout)
	defer cancel()
	// The replica's generation orders this engine's incarnations of it
	// on its server (wire's doc, "Incarnations"): a later one, opened
	// after the replica came back, makes what an older connection still
	// carries fail.
	return e.cfg.Connect(ctx, srv.DataAddress, wire.OpenRequest{
		Replica: r.Id, Volume: e.id, Node: e.cfg.NodeID, Epoch: e.epoch, Purpose: e.purpose, Incarnation: r.Generation,
	})
}

func (e *Engine) healthyCount() int {
	n := 0
	for _, m := range e.members {
		if m.info.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			n++
		}
	}
	return n
}

// ID is the volume id; Name its name; Epoch the epoch this engine holds.
func (e *Engine) ID() string     { return e.id }
func (e *Engine) Name() string   { return e.name }
func (e *Engine) Epoch() uint64  { return e.epoch }
func (e *Engine) Size() uint64   { return e.size.Load() }
func (e *Engine) Fenced() bool   { return e.fenced.Load() }
func (e *Engine) ReadOnly() bool { return e.cfg.ReadOnly }

// RebuildProgress reports the bytes this engine's rebuilds have copied
// since it opened (a counter: its rate is the rebuild rate) and the bytes
// its running rebuilds have left to copy, as of their last progress
// report (about once a second).
func (e *Engine) RebuildProgress() (copied, remaining int64) {
	return e.rebuildCopied.Load(), e.rebuildLeft.Load()
}

// Generation is the replica-set generation the engine writes under.
func (e *Engine) Generation() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.generation
}

// op is the request header for the current generation.
func (e *Engine) op(fua bool) replica.Op {
	e.mu.Lock()
	defer e.mu.Unlock()
	return replica.Op{Epoch: e.epoch, Generation: e.generation, FUA: fua}
}

// writeSet returns the replicas a write goes to (healthy and rebuilding).
func (e *Engine) writeSet() []*member {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*member, 0, len(e.members))
	for _, m := range e.members {
		out = append(out, m)
	}
	return out
}

// readSet returns the healthy replicas, the local one first.
func (e *Engine) readSet() []*member {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*member, 0, len(e.members))
	for _, m := range e.members {
		if m.info.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			out = append(out, m)
		}
	}
	// The local replica first, then a stable order, so that reads go to
	// the same replica while the set is unchanged.
	slices.SortFunc(out, func(a, b *member) int {
		al, bl := e.isLocal(a.info.ServerId), e.isLocal(b.info.ServerId)
		switch {
		case al != bl && al:
			return -1
		case al != bl:
			return 1
		}
		return strings.Compare(a.info.Id, b.info.Id)
	})
	return out
}

func (e *Engine) usable() error {
	switch {
	case e.closed.Load():
		return ErrClosed
	case e.fenced.Load():
		return ErrFenced
	case e.broken.Load():
		return fmt.Errorf("%w: volume %s: a replica failure could not be recorded; reopen the volume", ErrIO, e.name)
	}
	return nil
}

// beginWrite registers a write of [off, off+n) once no overlapping
// request registered before it is in flight (overlaps), then holds
// quiesce shared until endWrite, so a snapshot cut waits for it. A write
// registered after Close began is refused: Close's flush waits for every
// write registered before it, and no write may follow it.
func (e *Engine) beginWrite(ctx context.Context, off, n int64) (*span, error) {
	sp, err := e.overlaps.lock(ctx, spanWrite, off, n)
	if err != nil {
		return nil, err
	}
	if e.closed.Load() {
		e.overlaps.unlock(sp)
		return nil, ErrClosed
	}
	e.quiesce.RLock()
	e.trackLocal(off, n)
	return sp, nil
}

func (e *Engine) endWrite(sp *span) {
	e.quiesce.RUnlock()
	e.overlaps.unlock(sp)
}

func (e *Engine) checkRange(off, n int64) error {
	size := int64(e.size.Load())
	switch {
	case off < 0 || n < 0:
		return fmt.Errorf("%w: negative offset %d or length %d", replica.ErrInvalid, off, n)
	case off%replica.SectorSize != 0 || n%replica.SectorSize != 0:
		return fmt.Errorf("%w: offset %d or length %d not a multiple of %d", replica.ErrInvalid, off, n, replica.SectorSize)
	case off > size || n > size-off:
		return fmt.Errorf("%w: %d bytes at %d is past the end of the %d-byte volume", replica.ErrInvalid, n, off, size)
	}
	return nil
}

// ReadAt reads len(p) bytes at off from one healthy replica.
func (e *Engine) ReadAt(ctx context.Context, p []byte, off int64) error {
	if err := e.usable(); err != nil {
		return err
	}
	if err := e.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	for _, chunk := range chunks(off, int64(len(p))) {
		if err := e.readChunk(ctx, p[chunk.Off-off:chunk.Off-off+chunk.Len], chunk.Off); err != nil {
			return err
		}
	}
	return nil
}

// readChunk reads p at off from the first healthy replica that can serve
// it, once no write to the range registered before it is in flight
// (overlaps): a read never returns a value that is not yet on every
// replica (DESIGN.md, "Data path", point 6).
func (e *Engine) readChunk(ctx context.Context, p []byte, off int64) error {
	sp, err := e.overlaps.lock(ctx, spanRead, off, int64(len(p)))
	if err != nil {
		return err
	}
	defer e.overlaps.unlock(sp)
	// A write this read waited for may have stopped the engine (a
	// replica's failure it could not record).
	if err := e.usable(); err != nil {
		return err
	}
	for {
		set := e.readSet()
		if len(set) == 0 {
			return fmt.Errorf("%w: volume %s has no healthy replica to read from", ErrIO, e.name)
		}
		m := set[0]
		if e.readLocal(ctx, m, p, off) {
			return nil
		}
		err := e.call(ctx, func(ctx context.Context) error { return m.conn.ReadAt(ctx, e.op(false), p, off) })
		if err == nil {
			return nil
		}
		if err := e.classify(ctx, err); err != nil {
			return err
		}
		// The replica failed: report it (nothing is recorded if it left
		// the set meanwhile), then try the next one.
		if ferr := e.markFaulty(ctx, m, m.info.Id, err.Error()); ferr != nil {
			return ferr
		}
	}
}

// chunks splits a range into pieces of at most replica.MaxIO bytes.
func chunks(off, n int64) []replica.Extent {
	if n <= replica.MaxIO {
		return []replica.Extent{{Off: off, Len: n}}
	}
	return chunksOf(off, n, replica.MaxIO)
}

// WriteAt writes p at off on every replica; see the ack rule.
func (e *Engine) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	if err := e.writable(int64(len(p)), off); err != nil {
		return err
	}
	sp, err := e.beginWrite(ctx, off, int64(len(p)))
	if err != nil {
		return err
	}
	defer e.endWrite(sp)
	for _, c := range chunks(off, int64(len(p))) {
		buf := p[c.Off-off : c.Off-off+c.Len]
		if err := e.writeAll(ctx, e.writeSet(), buf, c.Off, fua); err != nil {
			return err
		}
	}
	return nil
}

// asyncWriter is a replica connection that can send a write and wait for
// its answer separately (wire handles can). When every replica's
// connection can, a write is sent to all of them from the calling
// goroutine and then waited for, instead of running a goroutine per
// replica, and the payload's checksum is computed once rather than once
// per replica (see docs/BENCHMARKS.md, "NBD end to end").
type asyncWriter interface {
	StartWriteAt(o replica.Op, p []byte, crc uint32, off int64) (wire.Pending, error)
}

// writeAll is fanOut for a write, with the same ack rule.
func (e *Engine) writeAll(ctx context.Context, set []*member, p []byte, off int64, fua bool) error {
	ctx = context.WithoutCancel(ctx)
	// A set too large for the stack, or a connection that cannot send
	// without waiting (test fakes, wrappers): a goroutine per replica.
	slow := func() error {
		return e.fanOut(ctx, set, func(ctx context.Context, m *member) error {
			return m.conn.WriteAt(ctx, e.op(fua), p, off)
		})
	}
	if len(set) == 0 || len(set) > maxAsyncSet {
		return slow()
	}
	var aw [maxAsyncSet]asyncWriter
	for i, m := range set {
		a, ok := m.conn.(asyncWriter)
		if !ok {
			return slow()
		}
		aw[i] = a
	}
	// The op is taken afresh on every round: after a fault the write is
	// applied again at the new generation (see settle).
	o := e.op(fua)
	var pend [maxAsyncSet]wire.Pending
	var errBuf [maxAsyncSet]error
	errs := errBuf[:len(set)]
	// One IOTimeout bounds every replica's answer, as in fanOut, where
	// the replicas run in parallel, each bounded by its own.
	wctx, cancel := context.WithTimeout(ctx, e.cfg.IOTimeout)
	crc := wire.Checksum(p) // once for every replica
	for i := range set {
		pend[i], errs[i] = aw[i].StartWriteAt(o, p, crc, off)
	}
	for i := range set {
		if errs[i] == nil {
			errs[i] = pend[i].Wait(wctx)
		}
	}
	cancel()
	return e.settle(ctx, set, errs, func(ok []*member) error {
		return e.writeAll(ctx, ok, p, off, fua)
	})
}

// maxAsyncSet is the largest replica set writeAll sends to without a
// goroutine per replica (its per-write state lives on the stack).
const maxAsyncSet = 8

// WriteZeroes makes a range read as zeroes on every replica.
func (e *Engine) WriteZeroes(ctx context.Context, off, n int64, fua bool) error {
	if err := e.writable(n, off); err != nil {
		return err
	}
	sp, err := e.beginWrite(ctx, off, n)
	if err != nil {
		return err
	}
	defer e.endWrite(sp)
	return zeroPieces(off, n, func(off, n int64) error {
		return e.fanOut(ctx, e.writeSet(), func(ctx context.Context, m *member) error {
			return m.conn.WriteZeroes(ctx, e.op(fua), off, n)
		})
	})
}

// zeroPieces runs f on [off, off+n) in pieces of at most replica.MaxZeroes
// bytes, the most one replica WriteZeroes or Trim may name (an NBD client
// may send up to 4 GiB), stopping at the first error. An empty range is
// one empty piece, as before the split.
func zeroPieces(off, n int64, f func(off, n int64) error) error {
	for {
		k := min(n, replica.MaxZeroes)
		if err := f(off, k); err != nil {
			return err
		}
		off, n = off+k, n-k
		if n <= 0 {
			return nil
		}
	}
}

// Trim discards a range on every replica (it then reads as zeroes).
func (e *Engine) Trim(ctx context.Context, off, n int64) error {
	if err := e.writable(n, off); err != nil {
		return err
	}
	sp, err := e.beginWrite(ctx, off, n)
	if err != nil {
		return err
	}
	defer e.endWrite(sp)
	return zeroPieces(off, n, func(off, n int64) error {
		return e.fanOut(ctx, e.writeSet(), func(ctx context.Context, m *member) error {
			return m.conn.Trim(ctx, e.op(false), off, n)
		})
	})
}

// Flush makes every acknowledged write durable on every replica (see
// flushOrdered for when it is sent).
func (e *Engine) Flush(ctx context.Context) error {
	if err := e.usable(); err != nil {
		return err
	}
	return e.flush(ctx)
}

// flush sends a flush to every replica in the write set, in flush order.
func (e *Engine) flush(ctx context.Context) error {
	return e.flushOrdered(ctx, func(ctx context.Context) error {
		return e.fanOut(ctx, e.writeSet(), func(ctx context.Context, m *member) error {
			return m.conn.Flush(ctx, e.op(false))
		})
	})
}

// flushOrdered runs flush, which sends a flush to some replicas, in flush
// order: after every earlier flush of this engine has finished, and after
// every write that began before it has been answered by every replica (or
// that replica was recorded faulty). The replicas' dirty-region logs
// clear a region two flushes after its last write (replica/doc.go, "Dirty
// regions"), which is safe only if no replica can still be waiting for a
// write the others finished two flushes ago: two flushes in flight
// together, or a flush that does not wait, let two replicas clear a
// region a third never received the write to, and after an unclean stop
// nothing would reconcile it (ISSUE13 D). Every path that flushes a
// replica of the volume goes through here.
//
// A broken engine flushes nothing (errBrokenFlush): the write whose
// failure broke it was answered by a replica that did not apply it and
// was not recorded faulty (the last healthy one, or a control plane out of
// reach), so "answered by every replica, or recorded faulty" no longer
// holds for it, and a flush would let the replicas that took it (a
// rebuilding target) clear its dirty region, which the next open
// reconciles by.
func (e *Engine) flushOrdered(ctx context.Context, flush func(context.Context) error) error {
	select {
	case e.flushTurn <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-e.flushTurn }()
	if err := e.overlaps.wait(ctx); err != nil {
		return err
	}
	if e.broken.Load() { // after the wait: a write that breaks it ends after it did
		return fmt.Errorf("%w: volume %s: %w", ErrIO, e.name, errBrokenFlush)
	}
	return flush(ctx)
}

// errBrokenFlush: see flushOrdered.
var errBrokenFlush = errors.New("a replica failure could not be recorded: nothing is flushed until the volume is reopened")

func (e *Engine) writable(n, off int64) error {
	if err := e.usable(); err != nil {
		return err
	}
	if e.cfg.ReadOnly {
		return fmt.Errorf("%w: volume %s is attached read-only", replica.ErrInvalid, e.name)
	}
	return e.checkRange(off, n)
}

// fanOut runs one request on every replica of set in parallel and applies
// the ack rule to the failures. The caller's cancellation does not reach
// the replicas: a request abandoned half-way would leave them different
// with nobody recorded faulty. Each replica request is bounded by
// IOTimeout instead (a replica that does not answer has failed), and a
// fault commit by FaultTimeout.
func (e *Engine) fanOut(ctx context.Context, set []*member, req func(context.Context, *member) error) error {
	ctx = context.WithoutCancel(ctx)
	if len(set) == 0 {
		return fmt.Errorf("%w: volume %s has no replica to write to", ErrIO, e.name)
	}
	errs := make([]error, len(set))
	var wg sync.WaitGroup
	for i, m := range set[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i+1] = e.call(ctx, func(ctx context.Context) error { return req(ctx, m) })
		}()
	}
	errs[0] = e.call(ctx, func(ctx context.Context) error { return req(ctx, set[0]) })
	wg.Wait()
	return e.settle(ctx, set, errs, func(ok []*member) error { return e.fanOut(ctx, ok, req) })
}

// settle applies the ack rule to the answers errs of the replicas in set
// to one request; again repeats the request on the replicas that applied
// it, after a fault was recorded.
func (e *Engine) settle(ctx context.Context, set []*member, errs []error, again func(ok []*member) error) error {
	if !slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
		return nil
	}
	var ok []*member
	failed := false
	for i, err := range errs {
		if err == nil {
			ok = append(ok, set[i])
			continue
		}
		if err := e.classify(ctx, errs[i]); err != nil {
			return err
		}
		// The ack rule: commit the failed replica as faulty first. (One
		// that left the set while the request was on its way, recorded
		// faulty or removed, needs no write and nothing is recorded
		// (markFaulty); back since, it is a new incarnation whose rebuild
		// waits for this request and copies what it wrote, as the request
		// applied again below names it in the write history.)
		if ferr := e.markFaulty(ctx, set[i], set[i].info.Id, err.Error()); ferr != nil {
			return ferr
		}
		failed = true
	}
	if failed && len(ok) == 0 {
		// Every replica it went to failed and left: it is on none that
		// stays. (Recording the last healthy one faulty is refused, so
		// this is a set that changed entirely during one request.)
		return fmt.Errorf("%w: volume %s: every replica the request went to left the write set", ErrIO, e.name)
	}
	if failed {
		// The replicas that applied the request recorded it in their
		// write history at the generation before the fault; a delta
		// rebuild of the failed replica copies only regions written at or
		// after the fault's generation. Apply it again, at the new
		// generation, so the history names it. (Idempotent: the same
		// request, not yet acknowledged.)
		return again(ok)
	}
	return nil
}

// current reports whether m is the incarnation of its replica in the write
// set now.
func (e *Engine) current(m *member) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	cur := e.members[m.info.Id]
	return cur != nil && cur.incarnation == m.incarnation
}

// call runs one replica request bounded by IOTimeout.
func (e *Engine) call(ctx context.Context, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.IOTimeout)
	defer cancel()
	return f(ctx)
}

// classify decides what a replica error means for the whole request: nil
// when the replica alone failed (the caller reports it faulty), or the
// error the request fails with.
//
// replica.ErrInvalid is the replica's failure, not the request's: the
// engine checks every request against the volume (checkRange, writable)
// and splits it to the replicas' limits before any replica sees it, so a
// replica that refuses one is out of line with the volume (smaller than
// its committed size, say) while the others may have applied it.
func (e *Engine) classify(ctx context.Context, err error) error {
	switch {
	case errors.Is(err, replica.ErrStaleEpoch):
		e.fence("a replica refused our epoch")
		return fmt.Errorf("%w: %v", ErrFenced, err)
	case ctx.Err() != nil:
		return ctx.Err() // a read the caller gave up on; nothing is known about the replica
	}
	return nil
}

func (e *Engine) fence(why string) {
	if e.fenced.CompareAndSwap(false, true) {
		e.logger.Warn("engine fenced: a newer attach exists; refusing all further I/O", "why", why)
	}
}

// faultAnswer is what the control plane's answer to "record this replica
// faulty" means for the engine.
type faultAnswer int

const (
	// faultStop: the failure cannot be recorded. The replica may lack a
	// write the others applied and is still in the set: the engine stops
	// serving rather than acknowledge, or read from it.
	faultStop faultAnswer = iota
	// faultRecorded: committed; go on without the replica.
	faultRecorded
	// faultFenced: the control plane refused our epoch.
	faultFenced
	// faultLastHealthy: the replica is the last healthy one and stays
	// healthy in Raft; nothing can serve the request, and other replicas
	// (rebuilding ones) may have taken it: stop serving; the next open
	// reconciles them.
	faultLastHealthy
	// faultGone: the replica may have left the set (moved or removed)
	// after the request was sent; confirm it against the committed
	// volume, then go on without it.
	faultGone
	// faultRetry: no answer yet (no leader, a leader change mid-call, a
	// transient server failure): ask again until FaultTimeout, then stop.
	faultRetry
)

// faultAnswers is the one table of control-plane codes for a fault report.
// A code not in it is faultStop: an answer the engine does not understand
// never lets it go on with a replica that missed a write.
var faultAnswers = map[codes.Code]faultAnswer{
	codes.OK:                 faultRecorded,
	codes.Aborted:            faultFenced,
	codes.FailedPrecondition: faultLastHealthy,
	codes.NotFound:           faultGone,
	codes.Unavailable:        faultRetry,
	codes.DeadlineExceeded:   faultRetry,
	codes.Canceled:           faultRetry,
	codes.Internal:           faultRetry,
	codes.Unknown:            faultRetry,
	codes.ResourceExhausted:  faultRetry,
}

// markFaulty commits the replica as faulty in Raft, waiting through leader
// elections until FaultTimeout, and then drops it from the write set. It
// returns nil only once the replica is recorded faulty (or confirmed out
// of the set); any other outcome fences the engine or stops it (see
// faultAnswers), so a replica that missed a write is never read from
// again by this engine, whatever the control plane answered.
//
// m is the incarnation that failed (nil: a replica that never joined the
// set, one that failed to open). A report waits its turn (faultMu) and
// may retry through elections; once m has left the set meanwhile (the
// replica recorded faulty by an earlier report, and maybe back as a new
// incarnation) it records nothing and returns nil: the replica is out of
// the set m was in, as the caller needs, and a report decided on the old
// incarnation's failure must not throw the new one out.
func (e *Engine) markFaulty(ctx context.Context, m *member, replicaID, reason string) error {
	left := func() bool {
		if m != nil && !e.current(m) {
			e.logger.Info("a failed replica left the write set before its fault was recorded; nothing to record", "replica", replicaID)
			return true
		}
		return false
	}
	e.faultMu.Lock()
	defer e.faultMu.Unlock()
	if left() {
		return nil
	}
	e.logger.Warn("replica failed; recording it faulty", "replica", replicaID, "reason", reason)
	e.stopLocal(replicaID)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.FaultTimeout)
	defer cancel()
	backoff := 50 * time.Millisecond
	for {
		if left() {
			return nil
		}
		resp, err := e.cfg.Control.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
			VolumeId: e.id, ReplicaId: replicaID, State: storpb.ReplicaState_REPLICA_STATE_FAULTY,
			Epoch: e.epoch, Reason: reason,
		})
		switch faultAnswers[status.Code(err)] {
		case faultRecorded:
			e.applyVolume(resp.Volume)
			return nil
		case faultFenced:
			e.fence("the control plane refused our epoch")
			return fmt.Errorf("%w: %v", ErrFenced, err)
		case faultLastHealthy:
			return e.stop(replicaID, fmt.Errorf("replica %s failed (%s) and is the last healthy one: %v", replicaID, reason, err))
		case faultGone:
			v, gerr := e.cfg.Control.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: e.id}})
			switch {
			case gerr == nil && findReplica(v.Volume, replicaID) == nil:
				e.applyVolume(v.Volume)
				return nil
			case status.Code(gerr) == codes.NotFound:
				e.fence("the volume was deleted")
				return fmt.Errorf("%w: volume %s was deleted", ErrFenced, e.name)
			case gerr != nil && faultAnswers[status.Code(gerr)] != faultRetry:
				return e.stop(replicaID, fmt.Errorf("replica %s failed (%s); its removal could not be confirmed: %v", replicaID, reason, gerr))
			}
			// The view is unclear (no leader, or the volume still lists
			// the replica): wait and ask again.
		case faultRetry:
			// Never acknowledge on a guess: wait and ask again.
		default:
			return e.stop(replicaID, fmt.Errorf("replica %s failed (%s) and could not be recorded faulty: %v", replicaID, reason, err))
		}
		select {
		case <-ctx.Done():
			return e.stop(replicaID, fmt.Errorf("replica %s failed (%s) and the control plane could not be reached to record it: %v (last answer: %v)", replicaID, reason, ctx.Err(), err))
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// stop makes the engine stop serving (every later call fails with ErrIO)
// because a failed replica could not be recorded faulty: it may now differ
// from the others and is still in the set.
func (e *Engine) stop(replicaID string, cause error) error {
	if e.broken.CompareAndSwap(false, true) {
		e.logger.Error("a replica failure could not be recorded; the engine stops serving", "replica", replicaID, "err", cause)
	}
	return fmt.Errorf("%w: volume %s: %v", ErrIO, e.name, cause)
}

// applyVolume brings the write set in line with a committed volume: its
// generation and which of our replicas are still in it. Replicas new to
// the set, and size changes, are handled by follow.
func (e *Engine) applyVolume(v *storpb.Volume) {
	if v.Epoch > e.epoch {
		e.fence(fmt.Sprintf("volume is at epoch %d", v.Epoch))
		return
	}
	var drop []*member
	e.mu.Lock()
	if v.Generation < e.generation {
		e.mu.Unlock()
		return // an older view than the one we have
	}
	e.generation = v.Generation
	inVolume := map[string]*storpb.Replica{}
	for _, r := range v.Replicas {
		inVolume[r.Id] = r
	}
	for id, m := range e.members {
		r, ok := inVolume[id]
		if !ok || r.State == storpb.ReplicaState_REPLICA_STATE_FAULTY {
			drop = append(drop, m)
			delete(e.members, id)
			if ok {
				e.leftAt[id] = max(e.leftAt[id], r.Generation)
			}
			continue
		}
		// Members are immutable (requests in flight hold them): replace.
		e.members[id] = &member{info: r, conn: m.conn, local: m.local, incarnation: m.incarnation}
	}
	e.mu.Unlock()
	for _, m := range drop {
		e.logger.Info("replica left the write set", "replica", m.info.Id, "server", m.info.ServerId)
		m.local.close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		m.conn.Close(ctx)
		cancel()
	}
}

// Close flushes (in flush order: after the writes in flight; later writes
// are refused), closes the replicas and, if detach is set, detaches the
// volume in Raft. A fenced engine closes without flushing, and so does a
// broken one (flushOrdered).
func (e *Engine) Close(ctx context.Context, detach bool) error {
	if !e.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	if !e.fenced.Load() {
		if err := e.flush(ctx); errors.Is(err, errBrokenFlush) {
			e.logger.Warn("the engine stopped serving, so it closes without flushing; the volume's next open reconciles its replicas")
		} else {
			errs = append(errs, err)
		}
	}
	e.cancel()
	e.wg.Wait()
	if len(e.cfg.LocalReaders) > 0 {
		e.logger.Info("volume closing", "short_circuit_reads", e.localReads.Load())
	}
	for _, m := range e.writeSet() {
		m.local.close()
		errs = append(errs, m.conn.Close(ctx))
	}
	if detach && !e.fenced.Load() {
		_, err := e.cfg.Control.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{
			Volume: &storpb.VolumeRef{Id: e.id}, NodeId: e.cfg.NodeID,
		})
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func findReplica(v *storpb.Volume, id string) *storpb.Replica {
	for _, r := range v.GetReplicas() {
		if r.Id == id {
			return r
		}
	}
	return nil
}
