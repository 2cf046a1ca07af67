// Package attachtest is a fake of the kernel's nbd driver for package
// attach, for hosts without the nbd module: it keeps what the kernel keeps
// (devices, their backend, size and sockets) and speaks NBD's transmission
// phase on the sockets it is given, as the kernel does, so reads, writes
// and flushes through a fake device reach the engine for real. Only the
// block device node and the kernel's request queue are missing: requests
// are sent one at a time on the device's newest socket.
package attachtest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/nbd/kernel"
)

// NBD transmission constants (the kernel's simple replies).
const (
	requestMagic = 0x25609513
	replyMagic   = 0x67446698
	cmdRead      = 0
	cmdWrite     = 1
	cmdDisc      = 2
	cmdFlush     = 3
	// ioTimeout bounds one request on the fake device.
	ioTimeout = 30 * time.Second
)

// ErrNotConnected is I/O on a device that is not connected.
var ErrNotConnected = errors.New("attachtest: device not connected")

// Kernel is the fake nbd driver. The zero value is not usable; use
// NewKernel.
type Kernel struct {
	mu     sync.Mutex
	devs   map[int]*device // guarded by mu
	handle uint64          // guarded by mu
}

type device struct {
	mu        sync.Mutex // serialises requests on socks
	backend   string
	size      uint64
	connected bool
	socks     []net.Conn
	// timeout is the request timeout (kernel.NoTimeout for none), queue
	// the block queue's timer, as the kernel sets them.
	timeout, queue time.Duration
}

// queueTimer is the kernel's block-queue timer after a CONNECT or
// RECONFIGURE with a request timeout: the timeout, or 30 s for none
// (drivers/block/nbd.c, nbd_set_cmd_timeout).
func queueTimer(timeout time.Duration) time.Duration {
	if timeout == kernel.NoTimeout {
		return 30 * time.Second
	}
	return timeout
}

// NewKernel returns a fake kernel with no devices.
func NewKernel() *Kernel { return &Kernel{devs: map[int]*device{}} }

// Ops is the Kernel as package attach reaches it.
func (k *Kernel) Ops() *attach.Kernel {
	return &attach.Kernel{
		Dial: func() (attach.KernelConn, error) { return conn{k}, nil },
		Backend: func(i int) (string, error) {
			k.mu.Lock()
			defer k.mu.Unlock()
			if d := k.devs[i]; d != nil && d.connected {
				return d.backend, nil
			}
			return "", nil
		},
		OpenExclusive: func(i int) (attach.SyncCloser, error) {
			if k.dev(i) == nil {
				return nil, fmt.Errorf("attachtest: /dev/nbd%d: %w", i, os.ErrNotExist)
			}
			return file{k, i}, nil
		},
		SetQueueTimeout: func(i int, t time.Duration) error {
			d := k.dev(i)
			if d == nil {
				return fmt.Errorf("attachtest: /dev/nbd%d: %w", i, kernel.ErrNoDevice)
			}
			d.mu.Lock()
			defer d.mu.Unlock()
			d.queue = t
			return nil
		},
		QueueTimeout: func(i int) (time.Duration, error) {
			_, q := k.Timers(i)
			if k.dev(i) == nil {
				return 0, fmt.Errorf("attachtest: /dev/nbd%d: %w", i, kernel.ErrNoDevice)
			}
			return q, nil
		},
		SizeBytes: func(i int) (uint64, error) {
			d := k.dev(i)
			if d == nil {
				return 0, fmt.Errorf("attachtest: /dev/nbd%d: %w", i, kernel.ErrNoDevice)
			}
			d.mu.Lock()
			defer d.mu.Unlock()
			if !d.connected {
				return 0, nil
			}
			return d.size, nil
		},
	}
}

// Timers returns /dev/nbd<i>'s request timeout (kernel.NoTimeout for
// none) and block-queue timer.
func (k *Kernel) Timers(i int) (timeout, queue time.Duration) {
	d := k.dev(i)
	if d == nil {
		return 0, 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.timeout, d.queue
}

func (k *Kernel) dev(i int) *device {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.devs[i]
}

// file is an open device node: Sync is a flush, as fsync is.
type file struct {
	k *Kernel
	i int
}

func (f file) Sync() error  { return f.k.Flush(f.i) }
func (f file) Close() error { return nil }

// conn is one netlink connection.
type conn struct{ k *Kernel }

func take(fs []*os.File) ([]net.Conn, error) {
	var cs []net.Conn
	for _, f := range fs {
		c, err := net.FileConn(f)
		if err != nil {
			for _, c := range cs {
				c.Close()
			}
			return nil, fmt.Errorf("attachtest: %w", err)
		}
		cs = append(cs, c)
	}
	return cs, nil
}

func (c conn) Connect(_ context.Context, o kernel.Options) (int, error) {
	socks, err := take(o.Sockets)
	if err != nil {
		return 0, err
	}
	k := c.k
	k.mu.Lock()
	defer k.mu.Unlock()
	i := o.Index
	if i == kernel.AnyIndex {
		i = 0
		for k.devs[i] != nil && k.devs[i].connected {
			i++
		}
	} else if d := k.devs[i]; d != nil && d.connected {
		return 0, fmt.Errorf("attachtest: /dev/nbd%d: %w", i, unix.EBUSY)
	}
	k.devs[i] = &device{backend: o.Backend, size: o.Size, connected: true, socks: socks,
		timeout: o.Timeout, queue: queueTimer(o.Timeout)}
	return i, nil
}

func (c conn) Reconfigure(_ context.Context, i int, r kernel.Reconfig) error {
	d := c.k.dev(i)
	if d == nil {
		return fmt.Errorf("attachtest: %w", unix.EINVAL)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.connected || (d.backend != "" && d.backend != r.Backend) {
		return fmt.Errorf("attachtest: %w", unix.EINVAL)
	}
	socks, err := take(r.Sockets)
	if err != nil {
		return err
	}
	if r.Size != 0 {
		d.size = r.Size
	}
	if r.Timeout != 0 {
		d.timeout, d.queue = r.Timeout, queueTimer(r.Timeout)
	}
	d.socks = append(d.socks, socks...)
	return nil
}

func (c conn) Disconnect(_ context.Context, i int) error {
	d := c.k.dev(i)
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.connected {
		return nil
	}
	for _, s := range d.socks {
		s.SetDeadline(time.Now().Add(time.Second))
		s.Write(header(cmdDisc, 0, 0, 0))
		s.Close()
	}
	d.connected, d.socks = false, nil
	return nil
}

func (c conn) Status(_ context.Context, i int) (kernel.Device, error) {
	d := c.k.dev(i)
	if d == nil {
		return kernel.Device{}, kernel.ErrNoDevice
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return kernel.Device{Index: i, Connected: d.connected}, nil
}

func (conn) Close() error { return nil }

func header(typ uint16, handle, off uint64, length uint32) []byte {
	var h [28]byte
	binary.BigEndian.PutUint32(h[0:], requestMagic)
	binary.BigEndian.PutUint16(h[6:], typ)
	binary.BigEndian.PutUint64(h[8:], handle)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], length)
	return h[:]
}

// do sends one request on the device's newest socket and reads its reply
// into read (for reads).
func (k *Kernel) do(i int, typ uint16, off uint64, payload, read []byte) error {
	d := k.dev(i)
	if d == nil {
		return ErrNotConnected
	}
	k.mu.Lock()
	k.handle++
	h := k.handle
	k.mu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.connected || len(d.socks) == 0 {
		return ErrNotConnected
	}
	s := d.socks[len(d.socks)-1]
	s.SetDeadline(time.Now().Add(ioTimeout))
	defer s.SetDeadline(time.Time{})
	length := uint32(len(payload) + len(read))
	if _, err := s.Write(append(header(typ, h, off, length), payload...)); err != nil {
		return fmt.Errorf("attachtest: nbd%d: %w", i, err)
	}
	var r [16]byte
	if _, err := io.ReadFull(s, r[:]); err != nil {
		return fmt.Errorf("attachtest: nbd%d: %w", i, err)
	}
	if binary.BigEndian.Uint32(r[0:]) != replyMagic || binary.BigEndian.Uint64(r[8:]) != h {
		return fmt.Errorf("attachtest: nbd%d: bad reply % x", i, r)
	}
	if e := binary.BigEndian.Uint32(r[4:]); e != 0 {
		return fmt.Errorf("attachtest: nbd%d: %w", i, unix.Errno(e))
	}
	if len(read) > 0 {
		if _, err := io.ReadFull(s, read); err != nil {
			return fmt.Errorf("attachtest: nbd%d: %w", i, err)
		}
	}
	return nil
}

// WriteAt writes p at off on /dev/nbd<i>.
func (k *Kernel) WriteAt(i int, p []byte, off uint64) error { return k.do(i, cmdWrite, off, p, nil) }

// ReadAt reads len(p) bytes at off from /dev/nbd<i>.
func (k *Kernel) ReadAt(i int, p []byte, off uint64) error { return k.do(i, cmdRead, off, nil, p) }

// Flush flushes /dev/nbd<i>.
func (k *Kernel) Flush(i int) error { return k.do(i, cmdFlush, 0, nil, nil) }

// Size is /dev/nbd<i>'s size, 0 when it is not connected.
func (k *Kernel) Size(i int) uint64 {
	d := k.dev(i)
	if d == nil {
		return 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.connected {
		return 0
	}
	return d.size
}
