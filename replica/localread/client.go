package localread

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
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

// Path is the socket's path.
func (c *Client) Path() string { return c.path }

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
	case len(files) != 2:
		return fail(fmt.Errorf("localread: %s sent %d descriptors, want 2", c.path, len(files)))
	}
	// The View checks the server's end of the connection with a
	// non-blocking peek of its own descriptor.
	live, err := conn.File()
	if err != nil {
		return fail(fmt.Errorf("localread: %w", err))
	}
	conn.Close()
	conn = nil
	if !regular(files[0], 0) || !regular(files[1], 8) {
		live.Close()
		return fail(fmt.Errorf("localread: %s sent descriptors that are not a data file and an 8-byte read generation", c.path))
	}
	mem, err := unix.Mmap(int(files[1].Fd()), 0, 8, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		live.Close()
		return fail(fmt.Errorf("localread: map the read generation: %w", err))
	}
	files[1].Close() // the mapping outlives the descriptor
	v := &View{data: files[0], live: live, mem: mem, want: rep.Generation}
	v.gen = (*uint64)(unsafe.Pointer(&mem[0]))
	if !v.valid() {
		v.Close()
		return nil, fmt.Errorf("%w: invalidated while it was opened", ErrStale)
	}
	return v, nil
}

// roundTrip sends req and reads the reply and its descriptors. The
// connection is returned open (to be closed by the caller) when there is
// a reply.
func (c *Client) roundTrip(ctx context.Context, req request) (reply, []*os.File, *net.UnixConn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", c.path)
	if err != nil {
		return reply{}, nil, nil, fmt.Errorf("localread: %w", err)
	}
	conn := nc.(*net.UnixConn)
	rep, files, err := c.exchange(ctx, conn, req)
	return rep, files, conn, err
}

func (c *Client) exchange(ctx context.Context, conn *net.UnixConn, req request) (reply, []*os.File, error) {
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
		defer conn.SetDeadline(time.Time{})
	}
	b, err := json.Marshal(req)
	if err != nil {
		return reply{}, nil, err
	}
	if _, err := conn.Write(append(b, '\n')); err != nil {
		return reply{}, nil, fmt.Errorf("localread: send to %s: %w", c.path, err)
	}
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(2*4))
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
		err = checkPeer(conn)
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return reply{}, files, fmt.Errorf("localread: reply from %s: %w", c.path, err)
	}
	var rep reply
	if err := json.Unmarshal(buf[:n], &rep); err != nil {
		return reply{}, files, fmt.Errorf("localread: malformed reply from %s: %w", c.path, err)
	}
	if rep.Code != codeOK {
		return rep, files, fmt.Errorf("localread: %s: %w", rep.Error, errorOf(rep.Code))
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
	data *os.File
	live *os.File // the connection the server holds open while it runs
	mem  []byte
	gen  *uint64 // in mem
	want uint64

	mu     sync.RWMutex // held shared by reads, exclusively by Close
	closed bool
}

func (v *View) valid() bool { return atomic.LoadUint64(v.gen) == v.want }

// ReadAt reads len(p) bytes of the volume at off (a block past the data
// file's end reads as zeroes). It fails with ErrStale if the read
// generation moved before the read ended, or the server is gone: then p
// (which holds what the file held) must not be used.
func (v *View) ReadAt(p []byte, off int64) error {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if v.closed {
		return ErrStale
	}
	n, err := v.data.ReadAt(p, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("localread: %w", err)
	}
	clear(p[n:])
	// The server advances the counter before any change takes effect, so
	// a read that still sees it unchanged read the file as it was; and a
	// server that died cannot advance it, but its death closed the
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
	return errors.Join(unix.Munmap(v.mem), v.data.Close(), v.live.Close())
}

// regular reports whether f is a regular file of at least min bytes.
func regular(f *os.File, min int64) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode().IsRegular() && fi.Size() >= min
}
