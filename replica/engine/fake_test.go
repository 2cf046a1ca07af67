package engine_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// memReplica is an in-memory replica that fences by epoch like the real
// store, with switches to make it fail.
type memReplica struct {
	mu       sync.Mutex
	id       string
	data     []byte
	epoch    uint64
	dirty    map[int64]bool // region offsets (1 MiB) written since the last flush
	flushes  int
	failIO   bool // every request fails with ErrIO
	failHist bool // WrittenSince fails with ErrIO
	failRead bool // ReadAt fails with ErrIO (writes go on)
	// copyFails: RebuildCopy into this replica cannot read its source, as
	// when the two servers are cut off from each other.
	copyFails bool
	hold      chan struct{} // if set, writes block until it is closed
	gates     gates         // other requests held by kind
	writes    int
	written   int64    // bytes of the writes counted in writes
	accepted  []uint64 // epochs of accepted writes

	allocated  map[int64]bool   // 4 KiB blocks ever written
	history    map[int64]uint64 // region -> highest generation written
	protected  map[int64]bool   // blocks written since BeginRebuild (nil: no rebuild)
	rebuilds   int              // completed rebuilds
	rebuildOps int              // RebuildWrite calls (chunks relayed through the rebuilder)
	copies     int              // RebuildCopy calls that copied (chunks the target read itself)
	reads      int              // ReadAt calls
	digests    int              // Digests calls
	noDigest   bool             // Digests fails with wire.ErrUnknownOp, as a server that predates DIGEST

	set *memReplicas // the set it is in, where RebuildCopy finds its source
}

const region = 1 << 20

func newMemReplica(id string, size int) *memReplica {
	return &memReplica{id: id, data: make([]byte, size), dirty: map[int64]bool{},
		allocated: map[int64]bool{}, history: map[int64]uint64{}}
}

func (r *memReplica) fence(epoch uint64) error {
	if epoch < r.epoch {
		return fmt.Errorf("%w: %d < %d", replica.ErrStaleEpoch, epoch, r.epoch)
	}
	r.epoch = epoch
	return nil
}

func (r *memReplica) check(o replica.Op, off, n int64) error {
	if err := r.fence(o.Epoch); err != nil {
		return err
	}
	if r.failIO {
		return fmt.Errorf("%w: injected", replica.ErrIO)
	}
	if off < 0 || n < 0 || off+n > int64(len(r.data)) {
		return fmt.Errorf("%w: range", replica.ErrInvalid)
	}
	return nil
}

func (r *memReplica) snapshot() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]byte(nil), r.data...)
}

// conn is one opened connection to a memReplica.
type conn struct{ r *memReplica }

func (c conn) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, off, int64(len(p))); err != nil {
		return err
	}
	if c.r.failRead {
		return fmt.Errorf("%w: injected (read)", replica.ErrIO)
	}
	c.r.reads++
	copy(p, c.r.data[off:])
	return nil
}

func (c conn) Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, off, int64(n)); err != nil {
		return nil, err
	}
	switch {
	case c.r.noDigest:
		return nil, fmt.Errorf("fake: DIGEST: %w", wire.ErrUnknownOp)
	case c.r.failRead:
		return nil, fmt.Errorf("%w: injected (digest)", replica.ErrIO)
	}
	c.r.digests++
	return wire.BlockDigests(nil, c.r.data[off:off+int64(n)]), nil
}

func (c conn) WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	c.r.mu.Lock()
	hold := c.r.hold
	c.r.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, off, int64(len(p))); err != nil {
		return err
	}
	copy(c.r.data[off:], p)
	for b := off / 4096; b*4096 < off+int64(len(p)); b++ {
		c.r.allocated[b] = true
		if c.r.protected != nil {
			c.r.protected[b] = true
		}
	}
	for reg := off / region * region; reg < off+int64(len(p)); reg += region {
		c.r.dirty[reg] = true
		c.r.history[reg] = max(c.r.history[reg], o.Generation)
	}
	c.r.writes++
	c.r.written += int64(len(p))
	c.r.accepted = append(c.r.accepted, o.Epoch)
	return nil
}

func (c conn) Extents(ctx context.Context, o replica.Op, snap string, from int64, limit int) ([]replica.Extent, error) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return nil, err
	}
	var out []replica.Extent
	for b := from / 4096; b*4096 < int64(len(c.r.data)); b++ {
		if c.r.allocated[b] {
			out = append(out, replica.Extent{Off: b * 4096, Len: 4096})
			if limit > 0 && len(out) == limit {
				break
			}
		}
	}
	return out, nil
}

func (c conn) WrittenSince(ctx context.Context, o replica.Op, gen uint64) ([]replica.Extent, error) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return nil, err
	}
	if c.r.failHist {
		return nil, fmt.Errorf("%w: injected (history)", replica.ErrIO)
	}
	var out []replica.Extent
	for reg, g := range c.r.history {
		if g >= gen {
			out = append(out, replica.Extent{Off: reg, Len: region})
		}
	}
	return out, nil
}

func (c conn) BeginRebuild(ctx context.Context, o replica.Op) error {
	if err := c.r.gates.pass(ctx, "BeginRebuild"); err != nil {
		return err
	}
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return err
	}
	if c.r.protected == nil { // as the store: a rebuild in progress keeps its tracking
		c.r.protected = map[int64]bool{}
	}
	return nil
}

func (c conn) RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, off, int64(len(p))); err != nil {
		return err
	}
	c.r.rebuildOps++
	c.r.rebuildLocked(p, off)
	return nil
}

// RebuildCopy is REBUILD_COPY as a target's server makes it (it makes the
// fake an engine.CopyTarget): it reads the source replica of its set,
// whose own checks apply, and applies the bytes as RebuildWrite does. A
// source it cannot read, and any source while copyFails is set, is
// wire.ErrCopySource, and nothing is written.
func (c conn) RebuildCopy(ctx context.Context, o replica.Op, source string, off, n int64, budget time.Duration) error {
	c.r.mu.Lock()
	fails, set := c.r.copyFails, c.r.set
	c.r.mu.Unlock()
	if fails || set == nil {
		return fmt.Errorf("fake: copy from %s: cut off: %w", source, wire.ErrCopySource)
	}
	p := make([]byte, n)
	src := set.get(source)
	src.mu.Lock()
	err := src.check(o, off, n)
	if err == nil && src.failRead {
		err = fmt.Errorf("%w: injected (read)", replica.ErrIO)
	}
	if err == nil {
		copy(p, src.data[off:])
	}
	src.mu.Unlock()
	if err != nil {
		return fmt.Errorf("fake: copy from %s: %v: %w", source, err, wire.ErrCopySource)
	}
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, off, n); err != nil {
		return err
	}
	c.r.copies++
	c.r.rebuildLocked(p, off)
	return nil
}

// chunksCopied counts the rebuild chunks applied, relayed or copied by
// the target.
func (r *memReplica) chunksCopied() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.rebuildOps + r.copies
}

// rebuildLocked applies a rebuild write: every 4 KiB block but those a
// normal write touched since BeginRebuild.
func (r *memReplica) rebuildLocked(p []byte, off int64) {
	for i := int64(0); i < int64(len(p)); i += 4096 {
		b := (off + i) / 4096
		if r.protected[b] {
			continue
		}
		copy(r.data[off+i:off+i+4096], p[i:i+4096])
		r.allocated[b] = true
	}
}

func (c conn) EndRebuild(ctx context.Context, o replica.Op) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return err
	}
	c.r.protected = nil
	c.r.rebuilds++
	return nil
}

func (c conn) WriteZeroes(ctx context.Context, o replica.Op, off, n int64) error {
	return c.WriteAt(ctx, o, make([]byte, n), off)
}

func (c conn) Trim(ctx context.Context, o replica.Op, off, n int64) error {
	return c.WriteZeroes(ctx, o, off, n)
}

func (c conn) Flush(ctx context.Context, o replica.Op) error {
	if err := c.r.gates.pass(ctx, "Flush"); err != nil {
		return err
	}
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return err
	}
	c.r.flushes++
	clear(c.r.dirty)
	return nil
}

func (c conn) Grow(ctx context.Context, o replica.Op, size uint64) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return err
	}
	if int(size) > len(c.r.data) {
		c.r.data = append(c.r.data, make([]byte, int(size)-len(c.r.data))...)
	}
	return nil
}

func (c conn) DirtyRegions(ctx context.Context, o replica.Op) ([]replica.Extent, error) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return nil, err
	}
	var out []replica.Extent
	for off := range c.r.dirty {
		out = append(out, replica.Extent{Off: off, Len: region})
	}
	return out, nil
}

func (c conn) Close(ctx context.Context) error { return nil }

// memReplicas is a set of memReplicas addressed by replica id.
type memReplicas struct {
	mu   sync.Mutex
	size int
	byID map[string]*memReplica
}

func newMemReplicas(size int) *memReplicas {
	return &memReplicas{size: size, byID: map[string]*memReplica{}}
}

func (m *memReplicas) get(id string) *memReplica {
	m.mu.Lock()
	defer m.mu.Unlock()
	r := m.byID[id]
	if r == nil {
		r = newMemReplica(id, m.size)
		r.set = m
		m.byID[id] = r
	}
	return r
}

func (m *memReplicas) connect(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
	r, epoch := m.get(open.Replica), open.Epoch
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failIO {
		return nil, fmt.Errorf("%w: injected", replica.ErrIO)
	}
	if err := r.fence(epoch); err != nil {
		return nil, err
	}
	return &openConn{conn: conn{r}}, nil
}

// openConn is one connection to a memReplica, as the engine's Connect
// returns it: once closed, its requests fail, those in flight included
// (as a wire connection's calls fail when it closes), and a request held
// in the replica (hold) fails when released.
type openConn struct {
	conn
	closed atomic.Bool
}

func (c *openConn) check(err error) error {
	if c.closed.Load() {
		return fmt.Errorf("fake: connection to %s closed: %w", c.r.id, wire.ErrDisconnected)
	}
	return err
}

func (c *openConn) Close(ctx context.Context) error {
	c.closed.Store(true)
	return nil
}

func (c *openConn) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.ReadAt(ctx, o, p, off))
}

func (c *openConn) WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.WriteAt(ctx, o, p, off))
}

func (c *openConn) Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error) {
	if err := c.check(nil); err != nil {
		return nil, err
	}
	ds, err := c.conn.Digests(ctx, o, off, n)
	return ds, c.check(err)
}

func (c *openConn) Flush(ctx context.Context, o replica.Op) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.Flush(ctx, o))
}

func (c *openConn) BeginRebuild(ctx context.Context, o replica.Op) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.BeginRebuild(ctx, o))
}

func (c *openConn) EndRebuild(ctx context.Context, o replica.Op) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.EndRebuild(ctx, o))
}

func (c *openConn) RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.RebuildWrite(ctx, o, p, off))
}

func (c *openConn) RebuildCopy(ctx context.Context, o replica.Op, source string, off, n int64, budget time.Duration) error {
	if err := c.check(nil); err != nil {
		return err
	}
	return c.check(c.conn.RebuildCopy(ctx, o, source, off, n, budget))
}

// gates hold chosen kinds of request to one replica until released, so a
// test can stop a request half-way through the engine's fan-out.
type gates struct {
	mu   sync.Mutex
	held map[string]*gate // request kind ("Flush", "WriteAt", ...) -> its gate
	lost bool             // the connection is lost: every request fails
}

type gate struct {
	entered chan struct{} // one value per request that reached the gate
	release chan struct{} // closed when the gate opens
}

// shut holds the requests of kind op from now until open(op). Its
// entered channel receives once per request held (up to 64).
func (g *gates) shut(op string) *gate {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held == nil {
		g.held = map[string]*gate{}
	}
	x := &gate{entered: make(chan struct{}, 64), release: make(chan struct{})}
	g.held[op] = x
	return x
}

// open lets the held requests of kind op through, and later ones.
func (g *gates) open(op string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if x := g.held[op]; x != nil {
		close(x.release)
		delete(g.held, op)
	}
}

// pass waits at op's gate while it is shut.
func (g *gates) pass(ctx context.Context, op string) error {
	g.mu.Lock()
	x, lost := g.held[op], g.lost
	g.mu.Unlock()
	if lost {
		return fmt.Errorf("%s: %w: the connection was lost", op, replica.ErrIO)
	}
	if x == nil {
		return nil
	}
	select {
	case x.entered <- struct{}{}:
	default:
	}
	select {
	case <-x.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// count waits up to d for want requests to reach the gate and returns how
// many did.
func (x *gate) count(want int, d time.Duration) int {
	n := 0
	deadline := time.After(d)
	for n < want {
		select {
		case <-x.entered:
			n++
		case <-deadline:
			return n
		}
	}
	return n
}
