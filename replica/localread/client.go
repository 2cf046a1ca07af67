package localread

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// ErrStale: the View's read generation moved (an epoch, layer, rebuild,
// size or server change, see replica/shortcircuit.go); the read it
// answered must not be used, and the View must be dropped.
var ErrStale = errors.New("localread: view is stale")

// Client opens Views from one server's socket.
type Client struct {
	path     string
	serverID string
}

// Dial asks the server at the unix socket path for its id.
func Dial(ctx context.Context, path string) (*Client, error) {
	c := &Client{path: path}
	rep, files, conn, err := c.roundTrip(ctx, request{})
	closeFiles(files)
	if conn != nil {
		conn.Close()
	}
	if err != nil {
		return nil, err
	}
	if rep.ServerID == "" {
		return nil, fmt.Errorf("localread: %s did not say its server id", path)
	}
	c.serverID = rep.ServerID
	return c, nil
}

// ServerID is the id of the server behind the socket.
func (c *Client) ServerID() string { return c.serverID }

// Open opens a View of replica open.Replica of volume open.Volume at epoch
// open.Epoch. Its errors wrap replica.ErrStaleEpoch, ErrNotDirect,
// ErrNotFound or ErrInvalid as the server's did.
func (c *Client) Open(ctx context.Context, open wire.OpenRequest) (*View, error) {
	rep, files, conn, err := c.roundTrip(ctx, request{Replica: open.Replica, Volume: open.Volume, Epoch: open.Epoch})
	fail := func(err error) (*View, error) {
		closeFiles(files)
		if conn != nil {
			conn.Close()
		}
		return nil, err
	}
	switch {
	case err != nil:
		return fail(err)
	case rep.ServerID != c.serverID:
		return fail(fmt.Errorf("localread: %s is now server %q, not %q", c.path, rep.ServerID, c.serverID))
	case len(rep.Runs) == 0 || len(rep.Runs) > replica.MaxDirectLayers || len(files) != len(rep.Runs)+1:
		return fail(fmt.Errorf("localread: %s sent %d descriptors for %d layers", c.path, len(files), len(rep.Runs)))
	}
	index, err := readIndex(conn, rep.Runs)
	if err != nil {
		return fail(fmt.Errorf("localread: indexes from %s: %w", c.path, err))
	}
	// The View checks the server's end of the connection with a
	// non-blocking peek of its own descriptor.
	live, err := conn.File()
	if err != nil {
		return fail(fmt.Errorf("localread: %w", err))
	}
	conn.Close()
	conn = nil
	ok := regular(files[0], 8)
	for _, f := range files[1:] {
		ok = ok && regular(f, 0)
	}
	if !ok {
		live.Close()
		return fail(fmt.Errorf("localread: %s sent descriptors that are not an 8-byte read generation and data files", c.path))
	}
	mem, err := unix.Mmap(int(files[0].Fd()), 0, 8, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		live.Close()
		return fail(fmt.Errorf("localread: map the read generation: %w", err))
	}
	files[0].Close() // the mapping outlives the descriptor
	v := &View{layers: files[1:], index: index, live: live, mem: mem, want: rep.Generation}
	v.gen = (*uint64)(unsafe.Pointer(&mem[0]))
	if !v.valid() {
		v.Close()
		return nil, fmt.Errorf("%w: invalidated while it was opened", ErrStale)
	}
	return v, nil
}

// readIndex reads the runs the reply announced, checking that each
// layer's are sorted, disjoint and not empty.
func readIndex(r io.Reader, counts []int) ([][][2]uint64, error) {
	total := 0
	for _, n := range counts {
		if n < 0 || n > replica.MaxDirectRuns {
			return nil, fmt.Errorf("%d runs announced", n)
		}
		total += n
	}
	if total > replica.MaxDirectRuns {
		return nil, fmt.Errorf("%d runs announced", total)
	}
	br := bufio.NewReaderSize(r, 64<<10)
	var b [16]byte
	index := make([][][2]uint64, len(counts))
	for i, n := range counts {
		runs := make([][2]uint64, n)
		for k := range runs {
			if _, err := io.ReadFull(br, b[:]); err != nil {
				return nil, err
			}
			s, e := binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint64(b[8:])
			if e <= s || (k > 0 && s < runs[k-1][1]) {
				return nil, fmt.Errorf("layer %d: run %d [%d, %d) is empty or out of order", i, k, s, e)
			}
			runs[k] = [2]uint64{s, e}
		}
		index[i] = runs
	}
	if br.Buffered() > 0 {
		return nil, errors.New("more bytes than the runs announced")
	}
	return index, nil
}

// roundTrip sends req and reads the reply and its descriptors. The
// connection is returned open (to be closed by the caller) when there is
// a reply; what follows the reply's line is still to be read from it.
func (c *Client) roundTrip(ctx context.Context, req request) (reply, []*os.File, *replyConn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", c.path)
	if err != nil {
		return reply{}, nil, nil, fmt.Errorf("localread: %w", err)
	}
	conn := &replyConn{UnixConn: nc.(*net.UnixConn)}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	rep, files, err := c.exchange(conn, req)
	return rep, files, conn, err
}

// replyConn is a connection whose first read (the reply's line and its
// descriptors) may have taken bytes that follow the line: Read returns
// them first.
type replyConn struct {
	*net.UnixConn
	rest []byte
}

func (c *replyConn) Read(p []byte) (int, error) {
	if len(c.rest) > 0 {
		n := copy(p, c.rest)
		c.rest = c.rest[n:]
		return n, nil
	}
	return c.UnixConn.Read(p)
}

// File returns the connection's descriptor (for the View's liveness
// check), with no deadline left on it.
func (c *replyConn) File() (*os.File, error) {
	c.SetDeadline(time.Time{})
	return c.UnixConn.File()
}

func (c *Client) exchange(conn *replyConn, req request) (reply, []*os.File, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return reply{}, nil, err
	}
	// A server that refuses this peer answers and closes without reading
	// the request, so the send may fail (EPIPE) with the answer waiting:
	// it is read all the same, and says why.
	_, sendErr := conn.Write(append(b, '\n'))
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace((replica.MaxDirectLayers+1)*4))
	n, oobn, flags, _, err := conn.ReadMsgUnix(buf, oob)
	var files []*os.File
	if oobn > 0 {
		files = parseRights(oob[:oobn])
	}
	if err == nil && flags&unix.MSG_CTRUNC != 0 {
		err = errors.New("more descriptors than expected")
	}
	if err == nil {
		// The descriptors are trusted only from a server that runs as root
		// or as this process's user.
		err = checkPeer(conn.UnixConn)
	}
	if err != nil && sendErr != nil {
		return reply{}, files, fmt.Errorf("localread: send to %s: %w", c.path, sendErr)
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return reply{}, files, fmt.Errorf("localread: reply from %s: %w", c.path, err)
	}
	line, rest, found := bytes.Cut(buf[:n], []byte{'\n'})
	if !found {
		return reply{}, files, fmt.Errorf("localread: reply from %s: no complete line in %d bytes", c.path, n)
	}
	conn.rest = rest
	var rep reply
	if err := json.Unmarshal(line, &rep); err != nil {
		return reply{}, files, fmt.Errorf("localread: malformed reply from %s: %w", c.path, err)
	}
	if rep.Version != protocolVersion {
		return reply{}, files, fmt.Errorf("localread: %s speaks version %d of the protocol, not %d", c.path, rep.Version, protocolVersion)
	}
	if rep.Code != codeOK {
		return rep, files, fmt.Errorf("localread: %s: %w", rep.Error, errorOf(rep.Code))
	}
	if sendErr != nil {
		return reply{}, files, fmt.Errorf("localread: send to %s: %w", c.path, sendErr)
	}
	return rep, files, nil
}

func parseRights(oob []byte) []*os.File {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var files []*os.File
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "localread"))
		}
	}
	return files
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// ErrDenied: the server refused the peer.
var ErrDenied = errors.New("localread: denied")

func errorOf(code string) error {
	switch code {
	case codeStaleEpoch:
		return replica.ErrStaleEpoch
	case codeNotDirect:
		return replica.ErrNotDirect
	case codeNotFound:
		return replica.ErrNotFound
	case codeInvalid:
		return replica.ErrInvalid
	case codeDenied:
		return ErrDenied
	}
	return replica.ErrIO
}

// View reads one replica directly while its read generation holds.
type View struct {
	layers []*os.File    // oldest first, the head last
	index  [][][2]uint64 // each layer's runs at the open
	live   *os.File      // the connection the server holds open while it runs
	mem    []byte
	gen    *uint64 // in mem
	want   uint64

	// tracked holds the block ranges the reader's writes touched since
	// the open (Track), sorted and coalesced; guarded by wmu.
	wmu     sync.RWMutex
	tracked [][2]uint64

	mu     sync.RWMutex // held shared by reads, exclusively by Close
	closed bool
}

func (v *View) valid() bool { return atomic.LoadUint64(v.gen) == v.want }

// Layers is the number of layers the View reads.
func (v *View) Layers() int { return len(v.layers) }

// maxTracked bounds a View's tracked ranges.
const maxTracked = 1 << 16

// Track records that the reader is about to write, zero or trim n bytes
// at off: from then on those blocks are read from the head. It must be
// called before the write is sent, by the volume's only writer, which
// opened the View while none of its writes was in flight. A View of one
// layer needs none of it (every block is read from the head). It reports
// false when the View would track more than maxTracked ranges: drop it
// (a new one starts from the server's indexes again).
func (v *View) Track(off, n int64) bool {
	if n <= 0 || len(v.layers) == 1 {
		return true
	}
	s, e := uint64(off)/replica.BlockSize, uint64(off+n-1)/replica.BlockSize+1
	v.wmu.Lock()
	defer v.wmu.Unlock()
	t := v.tracked
	// The ranges from i to j-1 overlap or touch [s, e): merge them.
	i, _ := slices.BinarySearchFunc(t, s, func(r [2]uint64, s uint64) int {
		if r[1] < s {
			return -1
		}
		return 1
	})
	j := i
	for j < len(t) && t[j][0] <= e {
		s, e = min(s, t[j][0]), max(e, t[j][1])
		j++
	}
	if i == j && len(t) >= maxTracked {
		return false
	}
	v.tracked = slices.Replace(t, i, j, [2]uint64{s, e})
	return true
}

// in reports whether block b is in the sorted runs.
func in(runs [][2]uint64, b uint64) bool {
	k, _ := slices.BinarySearchFunc(runs, b, func(r [2]uint64, b uint64) int {
		if r[1] <= b {
			return -1
		}
		return 1
	})
	return k < len(runs) && runs[k][0] <= b
}

// owner is the layer block b is read from (an index into layers): the
// head for a block the reader wrote since the open or one the head's
// index held then; else the topmost older layer whose index held it;
// else the head, where such a block is a hole (the server punches
// unindexed head blocks when it opens a replica) or, with one layer,
// whatever the reader wrote since. The caller holds wmu.
func (v *View) owner(b uint64) int {
	top := len(v.layers) - 1
	if top == 0 || in(v.tracked, b) || in(v.index[top], b) {
		return top
	}
	for i := top - 1; i >= 0; i-- {
		if in(v.index[i], b) {
			return i
		}
	}
	return top
}

// segment is a part of a read served from one layer.
type segment struct {
	from, to int64 // volume offsets
	layer    int
}

// ReadAt reads len(p) bytes of the volume at off: each block from the
// layer owner names (zeroes past a file's end). It fails with ErrStale if
// the read generation moved before the read ended, or the server is gone:
// then p (which holds what the files held) must not be used. The caller
// keeps writes to the range out while it reads (the engine's overlaps),
// so the tracked ranges it looks at hold still.
func (v *View) ReadAt(p []byte, off int64) error {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if v.closed {
		return ErrStale
	}
	end := off + int64(len(p))
	bs := int64(replica.BlockSize)
	var segBuf [8]segment
	segs := segBuf[:0]
	v.wmu.RLock()
	for pos := off; pos < end; {
		o := v.owner(uint64(pos / bs))
		next := min(end, (pos/bs+1)*bs)
		for next < end && v.owner(uint64(next/bs)) == o {
			next = min(end, next+bs)
		}
		segs = append(segs, segment{pos, next, o})
		pos = next
	}
	v.wmu.RUnlock()
	for _, sg := range segs {
		buf := p[sg.from-off : sg.to-off]
		n, err := v.layers[sg.layer].ReadAt(buf, sg.from)
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("localread: %w", err)
		}
		clear(buf[n:])
	}
	// The server advances the counter before any change takes effect, so
	// a read that still sees it unchanged read the files as they were;
	// and a server that died cannot advance it, but its death closed the
	// connection first.
	if !v.valid() || !v.alive() {
		return ErrStale
	}
	return nil
}

// alive reports whether the server still holds the View's connection
// open: a non-blocking peek finds nothing to read (EAGAIN), not the end.
func (v *View) alive() bool {
	var b [1]byte
	for {
		_, _, err := unix.Recvfrom(int(v.live.Fd()), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch err {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return true
		}
		return false // EOF (n == 0), a byte the server never sends, or an error
	}
}

// Close releases the View; later reads fail with ErrStale.
func (v *View) Close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return nil
	}
	v.closed = true
	errs := []error{unix.Munmap(v.mem), v.live.Close()}
	for _, f := range v.layers {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}

// regular reports whether f is a regular file of at least min bytes.
func regular(f *os.File, min int64) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode().IsRegular() && fi.Size() >= min
}
