package pki

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

type logWriter struct{ t *testing.T }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger { return slog.New(slog.NewTextHandler(logWriter{t}, nil)) }

// issue writes a certificate for id from ca into dir and returns its files
// with bundle as the CA.
func issue(t *testing.T, ca *CA, dir string, id Identity, notBefore, notAfter time.Time, bundle string) Files {
	t.Helper()
	c, k, err := ca.Issue(id, notBefore, notAfter)
	if err != nil {
		t.Fatal(err)
	}
	f := LocalFiles(dir, id)
	f.CA = bundle
	if err := writeFile(f.Cert, c); err != nil {
		t.Fatal(err)
	}
	if err := writeFile(f.Key, k); err != nil {
		t.Fatal(err)
	}
	return f
}

type world struct {
	dir       string
	ca, other *CA
	bundle    string
}

func newWorld(t *testing.T) *world {
	t.Helper()
	w := &world{dir: t.TempDir()}
	var err error
	if w.ca, err = NewCA("test CA", time.Hour); err != nil {
		t.Fatal(err)
	}
	if w.other, err = NewCA("other CA", time.Hour); err != nil {
		t.Fatal(err)
	}
	w.bundle = filepath.Join(w.dir, "ca.crt")
	if err := writeFile(w.bundle, w.ca.CertPEM()); err != nil {
		t.Fatal(err)
	}
	return w
}

func (w *world) source(t *testing.T, ca *CA, id Identity, notBefore, notAfter time.Time) *Source {
	t.Helper()
	s, err := Load(issue(t, ca, w.dir, id, notBefore, notAfter, w.bundle), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// serve accepts connections on a loopback listener with cfg and reports,
// for each, the identity of the client or the handshake error.
func serve(t *testing.T, cfg *tls.Config) (string, <-chan error, <-chan Identity) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	errs, ids := make(chan error, 8), make(chan Identity, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				id, err := ConnIdentity(ctx, tls.Server(c, cfg))
				if err != nil {
					errs <- err
					return
				}
				ids <- id
				io.Copy(io.Discard, c)
			}()
		}
	}()
	return ln.Addr().String(), errs, ids
}

func dialWith(addr string, cfg *tls.Config) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer raw.Close()
	c := tls.Client(raw, cfg)
	if err := c.HandshakeContext(ctx); err != nil {
		return err
	}
	// In TLS 1.3 the server verifies the client after the client's
	// handshake is done: a refusal arrives as an alert on the first read.
	c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	_, err = c.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return nil
	}
	return err
}

func TestMutualHandshakeCarriesIdentities(t *testing.T) {
	w := newWorld(t)
	now := time.Now()
	srv := w.source(t, w.ca, Identity{RoleServer, "s1"}, now.Add(-time.Minute), now.Add(time.Hour))
	cli := w.source(t, w.ca, Identity{RoleCSINode, "node-a"}, now.Add(-time.Minute), now.Add(time.Hour))
	addr, errs, ids := serve(t, srv.ServerConfig())
	conn, err := cli.Dialer(nil)(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if got, err := ConnIdentity(context.Background(), conn); err != nil || got != (Identity{RoleServer, "s1"}) {
		t.Fatalf("client sees server %v, %v", got, err)
	}
	select {
	case got := <-ids:
		if got != (Identity{RoleCSINode, "node-a"}) {
			t.Fatalf("server sees client %v", got)
		}
	case err := <-errs:
		t.Fatal(err)
	case <-time.After(5 * time.Second):
		t.Fatal("no handshake")
	}
	if v := conn.(*tls.Conn).ConnectionState().Version; v != tls.VersionTLS13 {
		t.Fatalf("version %x, want TLS 1.3", v)
	}
}

func TestRefused(t *testing.T) {
	w := newWorld(t)
	now := time.Now()
	srv := w.source(t, w.ca, Identity{RoleServer, "s1"}, now.Add(-time.Minute), now.Add(time.Hour))
	good := w.source(t, w.ca, Identity{RoleOperator, "admin"}, now.Add(-time.Minute), now.Add(time.Hour))
	foreign := w.source(t, w.other, Identity{RoleOperator, "mallory"}, now.Add(-time.Minute), now.Add(time.Hour))
	expired := w.source(t, w.ca, Identity{RoleOperator, "old"}, now.Add(-2*time.Hour), now.Add(-time.Hour))
	node := w.source(t, w.ca, Identity{RoleCSINode, "n1"}, now.Add(-time.Minute), now.Add(time.Hour))

	raftAddr, _, _ := serve(t, srv.ServerConfig(RoleServer))
	anyAddr, _, _ := serve(t, srv.ServerConfig())
	noCert := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
	tls12 := good.ClientConfig()
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	if err := dialWith(anyAddr, good.ClientConfig()); err != nil {
		t.Fatalf("a good certificate is refused: %v", err)
	}
	for _, tc := range []struct {
		name string
		addr string
		cfg  *tls.Config
	}{
		{"no certificate", anyAddr, noCert},
		{"other CA", anyAddr, foreign.ClientConfig()},
		{"expired", anyAddr, expired.ClientConfig()},
		{"role not admitted", raftAddr, node.ClientConfig()},
		{"TLS 1.2", anyAddr, tls12},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := dialWith(tc.addr, tc.cfg); err == nil {
				t.Fatal("handshake accepted")
			}
		})
	}

	// The client side refuses servers the same way.
	for _, tc := range []struct {
		name string
		srv  *Source
	}{
		{"server of another CA", w.source(t, w.other, Identity{RoleServer, "rogue"}, now.Add(-time.Minute), now.Add(time.Hour))},
		{"expired server", w.source(t, w.ca, Identity{RoleServer, "old"}, now.Add(-2*time.Hour), now.Add(-time.Hour))},
		{"not a server", w.source(t, w.ca, Identity{RoleOperator, "imposter"}, now.Add(-time.Minute), now.Add(time.Hour))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, _, _ := serve(t, tc.srv.ServerConfig())
			if _, err := good.Dialer(nil)(context.Background(), "tcp", addr); err == nil {
				t.Fatal("client accepted the server")
			}
		})
	}
}

func TestRotationWithoutRestart(t *testing.T) {
	w := newWorld(t)
	now := time.Now()
	srv := w.source(t, w.ca, Identity{RoleServer, "s1"}, now.Add(-time.Minute), now.Add(time.Hour))
	var clock atomic.Int64 // nanoseconds after now
	srv.now = func() time.Time { return now.Add(time.Duration(clock.Load())) }
	cli := w.source(t, w.ca, Identity{RoleOperator, "admin"}, now.Add(-time.Minute), now.Add(time.Hour))
	addr, _, _ := serve(t, srv.ServerConfig())

	serial := func() string {
		t.Helper()
		c, err := cli.Dialer(nil)(context.Background(), "tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.(*tls.Conn).ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	before := serial()
	// Rotate the server's pair in place, as cert-manager does.
	issue(t, w.ca, w.dir, Identity{RoleServer, "s1"}, now.Add(-time.Minute), now.Add(2*time.Hour), w.bundle)
	if got := serial(); got != before {
		t.Fatalf("reloaded before ReloadInterval: %s", got)
	}
	clock.Add(int64(ReloadInterval))
	after := serial()
	if after == before {
		t.Fatal("the rotated certificate was not picked up")
	}

	// The CA bundle rotates too: a bundle with only another CA makes the
	// server refuse the clients of the old one.
	if err := writeFile(w.bundle, append(w.other.CertPEM(), '\n')); err != nil {
		t.Fatal(err)
	}
	clock.Add(int64(ReloadInterval))
	if err := dialWith(addr, cli.ClientConfig()); err == nil {
		t.Fatal("a client of the CA no longer in the bundle was accepted")
	}

	// A broken pair keeps the loaded one.
	if err := os.WriteFile(LocalFiles(w.dir, Identity{RoleServer, "s1"}).Key, []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	clock.Add(int64(ReloadInterval))
	if c, _ := srv.current(); c.Leaf.SerialNumber.String() != after {
		t.Fatal("a broken pair replaced the loaded certificate")
	}
}

func TestIdentityOf(t *testing.T) {
	w := newWorld(t)
	now := time.Now()
	src := w.source(t, w.ca, Identity{RoleCSINode, "worker-1.example"}, now, now.Add(time.Hour))
	if got := src.Identity(); got != (Identity{RoleCSINode, "worker-1.example"}) {
		t.Fatalf("identity %v", got)
	}
	if got := src.Identity().String(); got != "stor://csi-node/worker-1.example" {
		t.Fatalf("URI %s", got)
	}
	for _, bad := range []Identity{{"root", "x"}, {RoleServer, ""}, {RoleServer, "a/b"}, {RoleServer, "-x"}} {
		if _, _, err := w.ca.Issue(bad, now, now.Add(time.Hour)); !errors.Is(err, ErrIdentity) {
			t.Errorf("%v: %v, want ErrIdentity", bad, err)
		}
	}
}

func TestCheckLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:7400", true},
		{"[::1]:7400", true},
		{"localhost:7400", true},
		{"127.0.0.5:1", true},
		{":7400", false},
		{"0.0.0.0:7400", false},
		{"10.0.0.1:7400", false},
		{"stor-server-0.stor:7400", false},
	} {
		err := CheckLoopback(tc.addr)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.addr, err)
		}
		if err != nil && !errors.Is(err, ErrNotLoopback) {
			t.Errorf("%s: %v is not ErrNotLoopback", tc.addr, err)
		}
	}
}

func TestEnsureLocalKeepsWhatExists(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	ids := []Identity{{RoleServer, "s1"}, {RoleOperator, "stor-ctl"}}
	if err := EnsureLocal(dir, ids...); err != nil {
		t.Fatal(err)
	}
	first, err := os.ReadFile(LocalFiles(dir, ids[0]).Cert)
	if err != nil {
		t.Fatal(err)
	}
	if err := EnsureLocal(dir, append(ids, Identity{RoleServer, "s2"})...); err != nil {
		t.Fatal(err)
	}
	again, _ := os.ReadFile(LocalFiles(dir, ids[0]).Cert)
	if string(again) != string(first) {
		t.Fatal("EnsureLocal replaced an existing certificate")
	}
	for _, id := range append(ids, Identity{RoleServer, "s2"}) {
		s, err := Load(LocalFiles(dir, id), testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		if s.Identity() != id {
			t.Fatalf("%v loads as %v", id, s.Identity())
		}
	}
	fi, err := os.Stat(LocalFiles(dir, ids[0]).Key)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key mode %v, %v", fi.Mode(), err)
	}
}
