package kernel

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Errors. Kernel refusals are returned wrapped, with the errno the kernel
// gave (test with errors.Is(err, unix.EBUSY) and so on).
var (
	// ErrUnsupported: the kernel has no "nbd" generic-netlink family,
	// that is, the nbd module is not loaded (modprobe nbd) or not built.
	ErrUnsupported = errors.New("kernel: the kernel has no nbd netlink interface (is the nbd module loaded? modprobe nbd)")
	// ErrNetNamespace: the nbd module is loaded but its generic-netlink
	// family is not visible in this process's network namespace. Before
	// Linux 6.3 (a February 2023 patch made the family netns-aware) the
	// kernel answers for it only in the initial network namespace, so a
	// process in a container's own network namespace cannot attach:
	// run it in the host's (Kubernetes: hostNetwork: true).
	ErrNetNamespace = errors.New("kernel: the nbd netlink family is not visible in this network namespace (this kernel's nbd is not netns-aware: before Linux 6.3 it answers only in the initial network namespace)")
	// ErrNoDevice: no /dev/nbdN with that index exists.
	ErrNoDevice = errors.New("kernel: no such nbd device")
	// ErrInvalid: the request is wrong before it reaches the kernel.
	ErrInvalid = errors.New("kernel: invalid request")
)

// Generic netlink names and numbers of linux/nbd-netlink.h.
const (
	familyName    = "nbd"
	familyVersion = 1

	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3
	cmdLinkDead    = 4
	cmdStatus      = 5

	attrIndex             = 1
	attrSizeBytes         = 2
	attrBlockSizeBytes    = 3
	attrTimeout           = 4
	attrServerFlags       = 5
	attrClientFlags       = 6
	attrSockets           = 7
	attrDeadConnTimeout   = 8
	attrDeviceList        = 9
	attrBackendIdentifier = 10

	sockItem = 1
	sockFD   = 1

	deviceItem      = 1
	deviceIndex     = 1
	deviceConnected = 2
)

// Transmission flags (linux/nbd.h NBD_FLAG_*; the NBD protocol's bits),
// given to Connect as Options.ServerFlags.
const (
	FlagHasFlags        = 1 << 0
	FlagReadOnly        = 1 << 1
	FlagSendFlush       = 1 << 2
	FlagSendFUA         = 1 << 3
	FlagSendTrim        = 1 << 5
	FlagSendWriteZeroes = 1 << 6 // ignored before Linux 6.4
	FlagCanMultiConn    = 1 << 8
)

// Client flags (linux/nbd.h NBD_CFLAG_*).
const (
	// ClientDestroyOnDisconnect removes the /dev/nbdN node when the
	// device is disconnected.
	ClientDestroyOnDisconnect = 1 << 0
	// ClientDisconnectOnClose disconnects the device when the last
	// opener closes it.
	ClientDisconnectOnClose = 1 << 1
)

// AnyIndex asks Connect for the first free device (creating one if every
// existing device is in use).
const AnyIndex = -1

// Defaults of Options.
const (
	DefaultBlockSize       = 4096
	DefaultTimeout         = 30 * time.Second
	DefaultDeadConnTimeout = 120 * time.Second
)

// NoTimeout, as Options.Timeout or Reconfig.Timeout, turns the kernel's
// request timeout off (NBD_ATTR_TIMEOUT 0): on a device with one
// connection the kernel then never declares a live connection dead for a
// slow request, and its block-queue timer, which SetQueueTimeout sets,
// only resends requests whose connection was replaced (see the package
// documentation, "Requeue without a request timeout").
const NoTimeout time.Duration = -1

// Options configures Connect.
type Options struct {
	// Index is the device to connect (/dev/nbd<Index>), or AnyIndex for
	// the first free one. Note that the zero value means /dev/nbd0.
	Index int
	// Sockets are connected stream sockets (unix or TCP), each a
	// connection to the server already in the transmission phase;
	// at least one. More than one needs FlagCanMultiConn in ServerFlags.
	// The kernel takes its own references: the caller may close them
	// once Connect returns.
	Sockets []*os.File
	// Size of the device in bytes; required, a multiple of BlockSize.
	Size uint64
	// BlockSize is the logical and physical block size: a power of two
	// from 512 to the page size. Default 4096.
	BlockSize uint64
	// Timeout is the request timeout: a request unanswered that long is
	// resent (its socket is declared dead). It also bounds the I/O pause
	// after a server restart (see the package documentation). Whole
	// seconds (rounded up). Default 30s; NoTimeout turns it off.
	Timeout time.Duration
	// DeadConnTimeout is how long I/O waits for a Reconfigure once every
	// socket is dead, before it fails with EIO. Whole seconds (rounded
	// up). Default 120s.
	DeadConnTimeout time.Duration
	// ServerFlags are the export's transmission flags (Flag*), as the
	// handshake would have told them (nbd.Server.ExportInfo).
	ServerFlags uint64
	// ClientFlags are Client* flags. Default none.
	ClientFlags uint64
	// Backend identifies what the device serves (shown in
	// /sys/block/nbdN/backend). Reconfigure must then name the same.
	// Optional but recommended.
	Backend string
}

// Reconfig is a change to a connected device. Zero fields are left as
// they are.
type Reconfig struct {
	// Sockets replace dead ones (see the package documentation).
	Sockets []*os.File
	// Size is the new size in bytes (a multiple of the block size),
	// applied before Sockets (see "Resizing" in the package
	// documentation: never while a connection is dead).
	Size uint64
	// Timeout and DeadConnTimeout, as for Options (NoTimeout turns the
	// request timeout off). A Timeout given also resets the block
	// queue's timer (SetQueueTimeout) to the kernel's choice: Timeout,
	// or 30s when it is off (nbd_set_cmd_timeout); the requests the
	// Sockets wake start after it, with that timer.
	Timeout         time.Duration
	DeadConnTimeout time.Duration
	// Backend must equal the device's backend identifier when it has
	// one.
	Backend string
}

// Device is one nbd device as STATUS reports it.
type Device struct {
	Index int
	// Connected: the device has a configuration (it was connected and has
	// not been disconnected and released since). Its sockets may all be
	// dead.
	Connected bool
}

// Path returns the device node of an index: /dev/nbdN.
func Path(index int) string { return fmt.Sprintf("/dev/nbd%d", index) }

// Client talks to the kernel's nbd netlink family. Create it with Dial;
// Close it when done.
type Client struct {
	family genetlink.Family

	// mu serialises requests: each sets the socket's deadline.
	mu sync.Mutex
	c  *genetlink.Conn
}

// Dial opens a generic netlink socket and looks up the nbd family. It
// returns ErrUnsupported when the kernel has no nbd module loaded, and
// ErrNetNamespace (wrapped, with the kernel's release) when the module is
// loaded but its family is not visible in this network namespace.
// Every command but Status needs CAP_SYS_ADMIN.
func Dial() (*Client, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("kernel: open generic netlink socket: %w", err)
	}
	cl, err := newClient(c)
	if err != nil {
		c.Close()
		return nil, err
	}
	return cl, nil
}

// sysModule is where the kernel lists its modules (loaded ones, and
// built-in ones with parameters, as nbd's nbds_max); tests point it
// elsewhere. Unlike netlink families, it is the same in every network
// namespace.
var sysModule = "/sys/module"

// newClient looks the family up on an open connection (tests pass a fake).
func newClient(c *genetlink.Conn) (*Client, error) {
	f, err := c.GetFamily(familyName)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENOENT) {
			return nil, missingFamily()
		}
		return nil, fmt.Errorf("kernel: look up the nbd netlink family: %w", err)
	}
	return &Client{c: c, family: f}, nil
}

// Close closes the netlink socket.
func (c *Client) Close() error { return c.c.Close() }

// missingFamily says why the kernel answered that it has no nbd family:
// the module is not there (ErrUnsupported), or it is and the family is
// hidden from this network namespace (ErrNetNamespace, naming the
// kernel's release).
func missingFamily() error {
	if _, err := os.Stat(filepath.Join(sysModule, familyName)); err != nil {
		return ErrUnsupported
	}
	return fmt.Errorf("%w; this is Linux %s: run in the host's network namespace", ErrNetNamespace, kernelRelease())
}

// kernelRelease is uname -r, or "unknown".
func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}

// seconds converts a timeout to the kernel's whole seconds, rounding up.
func seconds(d time.Duration) uint64 {
	return uint64((d + time.Second - 1) / time.Second)
}

// timeoutAttr is NBD_ATTR_TIMEOUT for a request timeout: 0 is off.
func timeoutAttr(d time.Duration) uint64 {
	if d == NoTimeout {
		return 0
	}
	return seconds(d)
}

func validBlockSize(bs uint64) bool {
	return bs >= 512 && bs <= uint64(os.Getpagesize()) && bs&(bs-1) == 0
}

func encodeSockets(ae *netlink.AttributeEncoder, socks []*os.File) {
	ae.Nested(attrSockets, func(nae *netlink.AttributeEncoder) error {
		for _, f := range socks {
			nae.Nested(sockItem, func(s *netlink.AttributeEncoder) error {
				s.Uint32(sockFD, uint32(f.Fd()))
				return nil
			})
		}
		return nil
	})
}

// Connect configures a device with the given sockets and starts it, and
// returns its index. The device node is Path(index).
func (c *Client) Connect(ctx context.Context, o Options) (int, error) {
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.DeadConnTimeout == 0 {
		o.DeadConnTimeout = DefaultDeadConnTimeout
	}
	switch {
	case o.Index < AnyIndex || o.Index > math.MaxInt32:
		return 0, fmt.Errorf("%w: device index %d", ErrInvalid, o.Index)
	case len(o.Sockets) == 0:
		return 0, fmt.Errorf("%w: connect needs at least one socket", ErrInvalid)
	case len(o.Sockets) > 1 && o.ServerFlags&FlagCanMultiConn == 0:
		return 0, fmt.Errorf("%w: %d sockets need a server with CAN_MULTI_CONN", ErrInvalid, len(o.Sockets))
	case !validBlockSize(o.BlockSize):
		return 0, fmt.Errorf("%w: block size %d is not a power of two from 512 to %d", ErrInvalid, o.BlockSize, os.Getpagesize())
	case o.Size == 0 || o.Size%o.BlockSize != 0:
		return 0, fmt.Errorf("%w: size %d is not a positive multiple of the block size %d", ErrInvalid, o.Size, o.BlockSize)
	case (o.Timeout < 0 && o.Timeout != NoTimeout) || o.DeadConnTimeout < 0:
		return 0, fmt.Errorf("%w: negative timeout", ErrInvalid)
	}
	ae := netlink.NewAttributeEncoder()
	if o.Index != AnyIndex {
		ae.Uint32(attrIndex, uint32(o.Index))
	}
	ae.Uint64(attrSizeBytes, o.Size)
	ae.Uint64(attrBlockSizeBytes, o.BlockSize)
	ae.Uint64(attrTimeout, timeoutAttr(o.Timeout))
	ae.Uint64(attrDeadConnTimeout, seconds(o.DeadConnTimeout))
	ae.Uint64(attrServerFlags, o.ServerFlags)
	ae.Uint64(attrClientFlags, o.ClientFlags)
	if o.Backend != "" {
		ae.String(attrBackendIdentifier, o.Backend)
	}
	encodeSockets(ae, o.Sockets)
	msgs, err := c.execute(ctx, cmdConnect, netlink.Request, ae)
	if err != nil {
		return 0, fmt.Errorf("kernel: connect nbd device: %w", err)
	}
	for _, m := range msgs {
		ad, err := netlink.NewAttributeDecoder(m.Data)
		if err != nil {
			return 0, fmt.Errorf("kernel: connect: bad reply: %w", err)
		}
		for ad.Next() {
			if ad.Type() == attrIndex {
				return int(ad.Uint32()), nil
			}
		}
		if err := ad.Err(); err != nil {
			return 0, fmt.Errorf("kernel: connect: bad reply: %w", err)
		}
	}
	return 0, errors.New("kernel: connect: the kernel's reply names no device")
}

// Reconfigure changes a connected device: new sockets for dead ones, a new
// size, new timeouts.
func (c *Client) Reconfigure(ctx context.Context, index int, r Reconfig) error {
	if index < 0 || index > math.MaxInt32 {
		return fmt.Errorf("%w: device index %d", ErrInvalid, index)
	}
	if (r.Timeout < 0 && r.Timeout != NoTimeout) || r.DeadConnTimeout < 0 {
		return fmt.Errorf("%w: negative timeout", ErrInvalid)
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	if r.Backend != "" {
		ae.String(attrBackendIdentifier, r.Backend)
	}
	if r.Size != 0 {
		ae.Uint64(attrSizeBytes, r.Size)
	}
	if r.Timeout != 0 {
		ae.Uint64(attrTimeout, timeoutAttr(r.Timeout))
	}
	if r.DeadConnTimeout != 0 {
		ae.Uint64(attrDeadConnTimeout, seconds(r.DeadConnTimeout))
	}
	if len(r.Sockets) > 0 {
		encodeSockets(ae, r.Sockets)
	}
	if _, err := c.execute(ctx, cmdReconfigure, netlink.Request|netlink.Acknowledge, ae); err != nil {
		return fmt.Errorf("kernel: reconfigure %s: %w", Path(index), err)
	}
	return nil
}

// Disconnect disconnects a device: the kernel sends NBD_CMD_DISC on each
// socket, shuts the sockets down and fails queued I/O with EIO.
// Disconnecting a device that is not connected does nothing.
func (c *Client) Disconnect(ctx context.Context, index int) error {
	if index < 0 || index > math.MaxInt32 {
		return fmt.Errorf("%w: device index %d", ErrInvalid, index)
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	if _, err := c.execute(ctx, cmdDisconnect, netlink.Request|netlink.Acknowledge, ae); err != nil {
		if errors.Is(err, unix.EINVAL) {
			if _, serr := c.Status(ctx, index); errors.Is(serr, ErrNoDevice) {
				return fmt.Errorf("kernel: disconnect %s: %w", Path(index), ErrNoDevice)
			}
		}
		return fmt.Errorf("kernel: disconnect %s: %w", Path(index), err)
	}
	return nil
}

// Status reports one device; ErrNoDevice if it does not exist.
func (c *Client) Status(ctx context.Context, index int) (Device, error) {
	if index < 0 || index > math.MaxInt32 {
		return Device{}, fmt.Errorf("%w: device index %d", ErrInvalid, index)
	}
	devs, err := c.status(ctx, index)
	if err != nil {
		return Device{}, err
	}
	for _, d := range devs {
		if d.Index == index {
			return d, nil
		}
	}
	return Device{}, fmt.Errorf("%w: %s", ErrNoDevice, Path(index))
}

// Devices reports every nbd device, by index.
func (c *Client) Devices(ctx context.Context) ([]Device, error) {
	return c.status(ctx, AnyIndex)
}

func (c *Client) status(ctx context.Context, index int) ([]Device, error) {
	ae := netlink.NewAttributeEncoder()
	if index != AnyIndex {
		ae.Uint32(attrIndex, uint32(index))
	}
	msgs, err := c.execute(ctx, cmdStatus, netlink.Request, ae)
	if err != nil {
		return nil, fmt.Errorf("kernel: nbd status: %w", err)
	}
	var devs []Device
	for _, m := range msgs {
		d, err := decodeDeviceList(m.Data)
		if err != nil {
			return nil, fmt.Errorf("kernel: nbd status: bad reply: %w", err)
		}
		devs = append(devs, d...)
	}
	return devs, nil
}

// decodeDeviceList decodes NBD_ATTR_DEVICE_LIST:
//
//	[NBD_ATTR_DEVICE_LIST]
//	  [NBD_DEVICE_ITEM] [NBD_DEVICE_INDEX u32] [NBD_DEVICE_CONNECTED u8]
//	  ...
func decodeDeviceList(b []byte) ([]Device, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil, err
	}
	var devs []Device
	for ad.Next() {
		if ad.Type() != attrDeviceList {
			continue
		}
		ad.Nested(func(list *netlink.AttributeDecoder) error {
			for list.Next() {
				if list.Type() != deviceItem {
					continue
				}
				d := Device{Index: -1}
				list.Nested(func(item *netlink.AttributeDecoder) error {
					for item.Next() {
						switch item.Type() {
						case deviceIndex:
							d.Index = int(item.Uint32())
						case deviceConnected:
							d.Connected = item.Uint8() != 0
						}
					}
					return item.Err()
				})
				if d.Index >= 0 {
					devs = append(devs, d)
				}
			}
			return list.Err()
		})
	}
	return devs, ad.Err()
}

// execute sends one command and returns the replies, bounded by ctx.
func (c *Client) execute(ctx context.Context, cmd uint8, flags netlink.HeaderFlags, ae *netlink.AttributeEncoder) ([]genetlink.Message, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	data, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// Deadlines are best effort (a fake connection has none). The
	// kernel answers these commands without waiting on I/O but for a
	// resize from 6.9 ("Resizing" in the package documentation), which
	// the deadline cannot interrupt; a call it cuts short leaves the
	// kernel's reply unread on the socket, and every later call on this
	// client then reads the reply before its own and fails.
	if d, ok := ctx.Deadline(); ok {
		c.c.SetDeadline(d)
		defer c.c.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { c.c.SetDeadline(time.Now()) })
	defer stop()
	msgs, err := c.c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: familyVersion},
		Data:   data,
	}, c.family.ID, flags)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var errno unix.Errno
		if errors.As(err, &errno) {
			return nil, fmt.Errorf("%w (the kernel log, dmesg, says why)", errno)
		}
		return nil, err
	}
	return msgs, nil
}
