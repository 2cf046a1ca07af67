package nbd

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestIsLocal(t *testing.T) {
	cases := map[string]bool{
		"127.0.0.1:10809":   true,
		"127.0.0.2:0":       true,
		"localhost:10809":   true,
		"[::1]:10809":       true,
		"unix:/run/x.sock":  true,
		"0.0.0.0:10809":     false,
		":10809":            false,
		"[::]:10809":        false,
		"10.0.0.1:10809":    false,
		"example.com:10809": false,
		"garbage":           false,
	}
	for addr, want := range cases {
		if got := IsLocal(addr); got != want {
			t.Errorf("IsLocal(%q) = %v, want %v", addr, got, want)
		}
	}
}

func TestURI(t *testing.T) {
	cases := []struct {
		addr   net.Addr
		export string
		want   string
	}{
		{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 10809}, "db", "nbd://127.0.0.1:10809/db"},
		{&net.TCPAddr{IP: net.IPv6loopback, Port: 10809}, "db", "nbd://[::1]:10809/db"},
		{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}, "a b/c", "nbd://127.0.0.1:1/a%20b%2Fc"},
		{&net.UnixAddr{Name: "/run/db.sock", Net: "unix"}, "db", "nbd+unix:///db?socket=/run/db.sock"},
	}
	for _, tc := range cases {
		if got := URI(tc.addr, tc.export); got != tc.want {
			t.Errorf("URI(%v, %q) = %q, want %q", tc.addr, tc.export, got, tc.want)
		}
	}
}

// Listen replaces a socket file nobody accepts on (left by a killed
// server) but refuses a live one; Serve works over it.
func TestListenUnix(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	// A stale socket: bound, never accepting, its listener gone without
	// unlinking the file.
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	syscall.Close(fd)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("stale socket not created: %v", err)
	}

	ln, err := Listen("unix:" + path)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer ln.Close()
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v (%v), want 0600: only its owner may connect", fi.Mode().Perm(), err)
	}
	if _, err := Listen("unix:" + path); err == nil || !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("Listen over a live socket: %v, want EADDRINUSE", err)
	}
	if _, err := Listen("unix:"); err == nil {
		t.Fatal("Listen(unix:) with no path succeeded")
	}
	if _, err := Listen("127.0.0.1:notaport"); err == nil || !strings.Contains(err.Error(), "127.0.0.1:notaport") {
		t.Fatalf("Listen on a bad TCP address: %v", err)
	}

	s := newTestServer(t, nil, nil)
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	nc, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c := newRawClient(t, nc)
	c.handshake("")
	if e := c.write(0, pattern(4096, 1), cmdFlagFUA); e != 0 {
		t.Fatal(e)
	}
	c.send(cmdDisc, 0, 0, 0, nil)
	c.expectEOF()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve after Shutdown: %v", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket file left after Shutdown: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	dev := newMemDevice(4096)
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no exports", Config{}, "no exports"},
		{"no device", Config{Exports: []Export{{Name: "a"}}}, "no device"},
		{"duplicate", Config{Exports: []Export{{Name: "a", Device: dev}, {Name: "a", Device: dev}}}, "given twice"},
		{"long name", Config{Exports: []Export{{Name: strings.Repeat("x", 4097), Device: dev}}}, "longer than"},
		{"block size", Config{Exports: []Export{{Name: "a", Device: dev, MinBlockSize: 1000}}}, "power of two"},
		{"payload", Config{Exports: []Export{{Name: "a", Device: dev, MinBlockSize: 4096}}, MaxPayload: 6144}, "not a multiple"},
		{"default", Config{Exports: []Export{{Name: "a", Device: dev}, {Name: "b", Device: dev}}, DefaultExport: "c"}, "default export"},
		{"in-flight bytes", Config{Exports: []Export{{Name: "a", Device: dev}}, MaxInFlightBytes: 1}, "MaxInFlightBytes"},
		{"ok", Config{Exports: []Export{{Name: "a", Device: dev}}}, ""},
	}
	for _, tc := range cases {
		err := tc.cfg.Validate()
		if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: Validate() = %v, want %q", tc.name, err, tc.want)
		}
	}
}

func TestErrnoOf(t *testing.T) {
	if errnoOf(nil) != 0 {
		t.Fatal("errnoOf(nil) != 0")
	}
	if got := errnoOf(context.Canceled); got != ESHUTDOWN {
		t.Fatalf("errnoOf(Canceled) = %v", got)
	}
	if got := errnoOf(context.DeadlineExceeded); got != EIO {
		t.Fatalf("errnoOf(DeadlineExceeded) = %v", got)
	}
}
