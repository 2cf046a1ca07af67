package kernel

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// request is a decoded nbd netlink request, as the fake kernel saw it.
type request struct {
	cmd   uint8
	flags netlink.HeaderFlags
	attrs map[uint16]any // uint32, uint64, string, or []uint32 (socket fds)
}

// fakeKernel answers the nbd family's commands with reply (which may be
// nil) and records the requests.
type fakeKernel struct {
	reqs  []request
	reply func(r request) ([]genetlink.Message, error)
}

const fakeFamilyID = 33

func (k *fakeKernel) dial(t *testing.T) *Client {
	t.Helper()
	conn := genltest.Dial(genltest.ServeFamily(
		genetlink.Family{ID: fakeFamilyID, Name: familyName, Version: familyVersion},
		func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
			if nreq.Header.Type != fakeFamilyID {
				t.Errorf("request to family %d, want %d", nreq.Header.Type, fakeFamilyID)
			}
			if greq.Header.Version != familyVersion {
				t.Errorf("request version %d, want %d", greq.Header.Version, familyVersion)
			}
			r := request{cmd: greq.Header.Command, flags: nreq.Header.Flags, attrs: decodeRequest(t, greq.Data)}
			if nreq.Header.Type == 0 && r.cmd == 0 {
				return nil, nil // a receive with nothing sent (nltest asks)
			}
			k.reqs = append(k.reqs, r)
			var msgs []genetlink.Message
			var err error
			if k.reply != nil {
				msgs, err = k.reply(r)
			}
			if err == nil && msgs == nil && r.flags&netlink.Acknowledge != 0 {
				return nil, genltest.Error(0) // the kernel's ACK
			}
			return msgs, err
		}))
	c, err := newClient(conn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func decodeRequest(t *testing.T, b []byte) map[uint16]any {
	t.Helper()
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	m := map[uint16]any{}
	for ad.Next() {
		switch ad.Type() {
		case attrIndex:
			m[attrIndex] = ad.Uint32()
		case attrBackendIdentifier:
			m[attrBackendIdentifier] = ad.String()
		case attrSockets:
			var fds []uint32
			ad.Nested(func(list *netlink.AttributeDecoder) error {
				for list.Next() {
					if list.Type() != sockItem {
						t.Errorf("socket list item of type %d", list.Type())
					}
					list.Nested(func(item *netlink.AttributeDecoder) error {
						for item.Next() {
							if item.Type() == sockFD {
								fds = append(fds, item.Uint32())
							}
						}
						return nil
					})
				}
				return nil
			})
			m[attrSockets] = fds
		default:
			m[ad.Type()] = ad.Uint64()
		}
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return m
}

// indexReply is the kernel's answer to NBD_CMD_CONNECT.
func indexReply(index uint32) []genetlink.Message {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	b, _ := ae.Encode()
	return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect, Version: familyVersion}, Data: b}}
}

func sockets(t *testing.T, n int) []*os.File {
	t.Helper()
	var fs []*os.File
	for range n {
		k, s, err := SocketPair()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { k.Close(); s.Close() })
		fs = append(fs, k)
	}
	return fs
}

func fds(fs []*os.File) []uint32 {
	var out []uint32
	for _, f := range fs {
		out = append(out, uint32(f.Fd()))
	}
	return out
}

func TestConnect(t *testing.T) {
	k := &fakeKernel{reply: func(request) ([]genetlink.Message, error) { return indexReply(3), nil }}
	c := k.dial(t)
	socks := sockets(t, 2)
	index, err := c.Connect(context.Background(), Options{
		Index:           AnyIndex,
		Sockets:         socks,
		Size:            64 << 20,
		Timeout:         1500 * time.Millisecond, // rounds up to 2 s
		ServerFlags:     FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagCanMultiConn,
		Backend:         "stor:vol-1",
		DeadConnTimeout: 0, // the default
	})
	if err != nil {
		t.Fatal(err)
	}
	if index != 3 {
		t.Fatalf("index %d, want the kernel's 3", index)
	}
	want := request{cmd: cmdConnect, flags: netlink.Request, attrs: map[uint16]any{
		// No NBD_ATTR_INDEX: any free device.
		attrSizeBytes:         uint64(64 << 20),
		attrBlockSizeBytes:    uint64(4096),
		attrTimeout:           uint64(2),
		attrDeadConnTimeout:   uint64(120),
		attrServerFlags:       uint64(FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagCanMultiConn),
		attrClientFlags:       uint64(0),
		attrBackendIdentifier: "stor:vol-1",
		attrSockets:           fds(socks),
	}}
	if len(k.reqs) != 1 || !reflect.DeepEqual(k.reqs[0], want) {
		t.Fatalf("requests:\n%+v\nwant\n%+v", k.reqs, want)
	}

	// A chosen index is sent.
	if _, err := c.Connect(context.Background(), Options{Index: 5, Sockets: socks[:1], Size: 4096}); err != nil {
		t.Fatal(err)
	}
	if got := k.reqs[1].attrs[attrIndex]; got != uint32(5) {
		t.Fatalf("NBD_ATTR_INDEX %v, want 5", got)
	}
}

func TestConnectInvalid(t *testing.T) {
	k := &fakeKernel{reply: func(request) ([]genetlink.Message, error) { return indexReply(0), nil }}
	c := k.dial(t)
	one, two := sockets(t, 1), sockets(t, 2)
	for _, tc := range []struct {
		name string
		o    Options
	}{
		{"no sockets", Options{Index: AnyIndex, Size: 4096}},
		{"no size", Options{Index: AnyIndex, Sockets: one}},
		{"size not a multiple of the block size", Options{Index: AnyIndex, Sockets: one, Size: 6144}},
		{"block size not a power of two", Options{Index: AnyIndex, Sockets: one, Size: 6144, BlockSize: 3072}},
		{"block size too small", Options{Index: AnyIndex, Sockets: one, Size: 4096, BlockSize: 256}},
		{"block size past the page size", Options{Index: AnyIndex, Sockets: one, Size: 1 << 20, BlockSize: 1 << 17}},
		{"bad index", Options{Index: -2, Sockets: one, Size: 4096}},
		{"several sockets without multi-conn", Options{Index: AnyIndex, Sockets: two, Size: 4096, ServerFlags: FlagHasFlags}},
		{"negative timeout", Options{Index: AnyIndex, Sockets: one, Size: 4096, Timeout: -time.Second}},
	} {
		if _, err := c.Connect(context.Background(), tc.o); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", tc.name, err)
		}
	}
	if len(k.reqs) != 0 {
		t.Fatalf("invalid requests reached the kernel: %+v", k.reqs)
	}
}

func TestReconfigure(t *testing.T) {
	k := &fakeKernel{}
	c := k.dial(t)
	socks := sockets(t, 1)
	if err := c.Reconfigure(context.Background(), 2, Reconfig{Sockets: socks, Backend: "stor:vol-1", Size: 128 << 20, Timeout: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
	// Only what is given is sent.
	if err := c.Reconfigure(context.Background(), 2, Reconfig{Backend: "stor:vol-1", DeadConnTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	want := []request{
		{cmd: cmdReconfigure, flags: netlink.Request | netlink.Acknowledge, attrs: map[uint16]any{
			attrIndex: uint32(2), attrBackendIdentifier: "stor:vol-1", attrSizeBytes: uint64(128 << 20),
			attrTimeout: uint64(10), attrSockets: fds(socks),
		}},
		{cmd: cmdReconfigure, flags: netlink.Request | netlink.Acknowledge, attrs: map[uint16]any{
			attrIndex: uint32(2), attrBackendIdentifier: "stor:vol-1", attrDeadConnTimeout: uint64(60),
		}},
	}
	if !reflect.DeepEqual(k.reqs, want) {
		t.Fatalf("requests:\n%+v\nwant\n%+v", k.reqs, want)
	}
}

// The kernel's errno comes back wrapped, for errors.Is.
func TestKernelErrors(t *testing.T) {
	k := &fakeKernel{reply: func(r request) ([]genetlink.Message, error) {
		if r.cmd == cmdConnect {
			return nil, genltest.Error(int(unix.EBUSY))
		}
		return nil, genltest.Error(int(unix.EINVAL))
	}}
	c := k.dial(t)
	_, err := c.Connect(context.Background(), Options{Index: 1, Sockets: sockets(t, 1), Size: 4096})
	if !errors.Is(err, unix.EBUSY) {
		t.Fatalf("connect of a busy device: %v, want EBUSY", err)
	}
	if err := c.Reconfigure(context.Background(), 1, Reconfig{Backend: "x"}); !errors.Is(err, unix.EINVAL) {
		t.Fatalf("reconfigure refused: %v, want EINVAL", err)
	}
}

func deviceListReply(devs ...Device) []genetlink.Message {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(attrDeviceList, func(list *netlink.AttributeEncoder) error {
		for _, d := range devs {
			list.Nested(deviceItem, func(item *netlink.AttributeEncoder) error {
				item.Uint32(deviceIndex, uint32(d.Index))
				var c uint8
				if d.Connected {
					c = 1
				}
				item.Uint8(deviceConnected, c)
				return nil
			})
		}
		return nil
	})
	b, _ := ae.Encode()
	return []genetlink.Message{{Header: genetlink.Header{Command: cmdStatus, Version: familyVersion}, Data: b}}
}

func TestStatus(t *testing.T) {
	all := []Device{{0, true}, {1, false}, {7, true}}
	k := &fakeKernel{reply: func(r request) ([]genetlink.Message, error) {
		if i, ok := r.attrs[attrIndex]; ok {
			for _, d := range all {
				if uint32(d.Index) == i {
					return deviceListReply(d), nil
				}
			}
			return deviceListReply(), nil // the kernel's answer for a missing index
		}
		return deviceListReply(all...), nil
	}}
	c := k.dial(t)
	devs, err := c.Devices(context.Background())
	if err != nil || !reflect.DeepEqual(devs, all) {
		t.Fatalf("Devices: %+v %v, want %+v", devs, err, all)
	}
	d, err := c.Status(context.Background(), 7)
	if err != nil || d != (Device{7, true}) {
		t.Fatalf("Status(7): %+v %v", d, err)
	}
	if _, err := c.Status(context.Background(), 9); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("Status of a missing device: %v, want ErrNoDevice", err)
	}
}

// The kernel answers ENOENT for the nbd family: without the module
// (not in /sys/module) that is ErrUnsupported; with it, the family is
// hidden from this network namespace (a kernel before 6.3 in a container's
// netns): ErrNetNamespace, which says so, and names the kernel.
func TestUnsupported(t *testing.T) {
	for _, tc := range []struct {
		name   string
		module bool
		want   error
		not    error
	}{
		{"no module", false, ErrUnsupported, ErrNetNamespace},
		{"module loaded, family hidden by the netns", true, ErrNetNamespace, ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			old := sysModule
			sysModule = root
			t.Cleanup(func() { sysModule = old })
			if tc.module {
				if err := os.MkdirAll(filepath.Join(root, "nbd", "parameters"), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			conn := genltest.Dial(func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
				return nil, genltest.Error(int(unix.ENOENT))
			})
			defer conn.Close()
			_, err := newClient(conn)
			if !errors.Is(err, tc.want) || errors.Is(err, tc.not) {
				t.Fatalf("newClient without the family: %v, want %v", err, tc.want)
			}
			if tc.module && !strings.Contains(err.Error(), "this is Linux "+kernelRelease()+": run in the host's network namespace") {
				t.Fatalf("newClient: %v: does not name the kernel's release %s", err, kernelRelease())
			}
			t.Logf("%s: %v", tc.name, err)
		})
	}
}

func TestParseDevice(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"/dev/nbd0", 0, true}, {"/dev/nbd12", 12, true}, {"nbd3", 3, true}, {"4", 4, true},
		{"/dev/sda", 0, false}, {"nbd", 0, false}, {"-1", 0, false}, {"/dev/nbd1p1", 0, false}, {"01", 0, false}, {"", 0, false},
	} {
		got, err := ParseDevice(tc.in)
		if tc.ok != (err == nil) || got != tc.want {
			t.Errorf("ParseDevice(%q) = %d, %v", tc.in, got, err)
		}
	}
}

func TestSysfs(t *testing.T) {
	root := t.TempDir()
	old := sysBlock
	sysBlock = root
	t.Cleanup(func() { sysBlock = old })
	dir := filepath.Join(root, "nbd2")
	os.MkdirAll(dir, 0o755)
	os.WriteFile(filepath.Join(dir, "size"), []byte("131072\n"), 0o644)

	if b, err := Backend(2); err != nil || b != "" {
		t.Fatalf("Backend of a disconnected device: %q %v", b, err)
	}
	os.WriteFile(filepath.Join(dir, "backend"), []byte("stor:vol-1\n"), 0o644)
	if b, err := Backend(2); err != nil || b != "stor:vol-1" {
		t.Fatalf("Backend: %q %v", b, err)
	}
	if n, err := SizeBytes(2); err != nil || n != 64<<20 {
		t.Fatalf("SizeBytes: %d %v", n, err)
	}
	if _, err := Backend(5); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("Backend of a missing device: %v", err)
	}
	if _, err := SizeBytes(5); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("SizeBytes of a missing device: %v", err)
	}

	// The block queue's timer, in milliseconds.
	os.MkdirAll(filepath.Join(dir, "queue"), 0o755)
	os.WriteFile(filepath.Join(dir, "queue", "io_timeout"), []byte("30000\n"), 0o644)
	if d, err := QueueTimeout(2); err != nil || d != 30*time.Second {
		t.Fatalf("QueueTimeout: %v %v", d, err)
	}
	if err := SetQueueTimeout(2, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "queue", "io_timeout")); string(b) != "500" {
		t.Fatalf("io_timeout holds %q, want 500", b)
	}
	if d, err := QueueTimeout(2); err != nil || d != 500*time.Millisecond {
		t.Fatalf("QueueTimeout after setting it: %v %v", d, err)
	}
	for _, d := range []time.Duration{0, time.Microsecond, -time.Second} {
		if err := SetQueueTimeout(2, d); !errors.Is(err, ErrInvalid) {
			t.Errorf("SetQueueTimeout(%v): %v, want ErrInvalid", d, err)
		}
	}
	if err := SetQueueTimeout(5, time.Second); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("SetQueueTimeout of a missing device: %v", err)
	}
	if _, err := QueueTimeout(5); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("QueueTimeout of a missing device: %v", err)
	}
}

// NoTimeout sends a request timeout of 0 (off), on Connect and
// Reconfigure; other negative timeouts are refused.
func TestNoTimeout(t *testing.T) {
	k := &fakeKernel{reply: func(r request) ([]genetlink.Message, error) {
		if r.cmd == cmdConnect {
			return indexReply(1), nil
		}
		return nil, nil
	}}
	c := k.dial(t)
	socks := sockets(t, 1)
	if _, err := c.Connect(context.Background(), Options{Index: AnyIndex, Sockets: socks, Size: 4096, Timeout: NoTimeout}); err != nil {
		t.Fatal(err)
	}
	if err := c.Reconfigure(context.Background(), 1, Reconfig{Backend: "b", Timeout: NoTimeout}); err != nil {
		t.Fatal(err)
	}
	if len(k.reqs) != 2 {
		t.Fatalf("%d requests, want 2", len(k.reqs))
	}
	for _, r := range k.reqs {
		if got := r.attrs[attrTimeout]; got != uint64(0) {
			t.Errorf("command %d: NBD_ATTR_TIMEOUT %v, want 0", r.cmd, got)
		}
	}
	if _, err := c.Connect(context.Background(), Options{Index: AnyIndex, Sockets: socks, Size: 4096, Timeout: -2}); !errors.Is(err, ErrInvalid) {
		t.Errorf("connect with timeout -2ns: %v, want ErrInvalid", err)
	}
	if err := c.Reconfigure(context.Background(), 1, Reconfig{Timeout: -time.Second}); !errors.Is(err, ErrInvalid) {
		t.Errorf("reconfigure with timeout -1s: %v, want ErrInvalid", err)
	}
	if len(k.reqs) != 2 {
		t.Fatalf("invalid requests reached the kernel: %+v", k.reqs[2:])
	}
}
