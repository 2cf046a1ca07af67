package server_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/wire"
)

// TestTLSClusterServesData: three servers join, elect, heartbeat and
// forward over mutual TLS, and an engine writes through the data ports to
// three replicas that read back equal.
func TestTLSClusterServesData(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{TLS: true})
	leader := c.Leader(10 * time.Second)
	follower := (leader + 1) % 3
	const size = 1 << 20
	v := createVolume(t, c.Client(follower), "tls", size, 3) // forwarded to the leader
	ctx := ctxT(t, time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	data := bytes.Repeat([]byte("stor over TLS. "), size/15+1)[:size]
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("read back differs")
	}
	sums := c.Checksums(v.Id)
	for _, s := range sums {
		if s.Err != nil || s.SHA256 != sums[0].SHA256 {
			t.Fatalf("replica digests %v", sums)
		}
	}
}

// tlsWorld is a one-server TLS cluster and certificates to attack it with.
type tlsWorld struct {
	c                      *servertest.Cluster
	operator, node, peer   *tls.Config // good certificates of this CA
	none, foreign, expired *tls.Config
	control, raft, data    string
}

func newTLSWorld(t *testing.T) *tlsWorld {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true})
	w := &tlsWorld{c: c, control: c.Nodes[0].Addr, raft: c.Nodes[0].RaftAddr, data: c.Nodes[0].DataAddr}
	client := func(id pki.Identity) *tls.Config { return c.TLSSource(id).ClientConfig() }
	w.operator = client(servertest.Operator)
	w.node = client(pki.Identity{Role: pki.RoleCSINode, Name: "n1"})
	w.peer = client(pki.Identity{Role: pki.RoleServer, Name: "s9"})
	w.none = &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}

	ca, err := pki.LoadCA(filepath.Join(c.TLSDir(), "ca.crt"), filepath.Join(c.TLSDir(), "ca.key"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := pki.NewCA("other", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	w.foreign = issueTo(t, other, servertest.Operator, now.Add(-time.Minute), now.Add(time.Hour), c.TLSDir())
	w.expired = issueTo(t, ca, servertest.Operator, now.Add(-2*time.Hour), now.Add(-time.Hour), c.TLSDir())
	return w
}

// issueTo makes a certificate for id from ca, trusting the bundle in
// bundleDir, and returns a client config presenting it.
func issueTo(t *testing.T, ca *pki.CA, id pki.Identity, notBefore, notAfter time.Time, bundleDir string) *tls.Config {
	t.Helper()
	cert, key, err := ca.Issue(id, notBefore, notAfter)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := pki.Files{Cert: filepath.Join(dir, "c.crt"), Key: filepath.Join(dir, "c.key"), CA: filepath.Join(bundleDir, "ca.crt")}
	if err := os.WriteFile(f.Cert, cert, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f.Key, key, 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := pki.Load(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	return src.ClientConfig()
}

// handshake dials addr with cfg and reports whether the server accepted
// the client: in TLS 1.3 the server's verdict on the client certificate
// arrives after the client's handshake completes, as an alert on the
// first read; a read that merely times out means the server kept the
// connection.
func handshake(addr string, cfg *tls.Config) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer raw.Close()
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"} // the control port is gRPC
	c := tls.Client(raw, cfg)
	if err := c.HandshakeContext(ctx); err != nil {
		return err
	}
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	_, err = c.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return nil
	}
	if err == nil {
		return nil // the server spoke first (gRPC's settings frame): accepted
	}
	return err
}

func (w *tlsWorld) status(t *testing.T, cfg *tls.Config) error {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+w.control, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = storpb.NewClusterServiceClient(conn).Status(ctx, &storpb.StatusRequest{})
	return err
}

// TestTLSPortsRefuseUnauthenticated: on each of the control, Raft and data
// ports, no certificate, a certificate of another CA and an expired one
// are refused; the Raft port admits servers only.
func TestTLSPortsRefuseUnauthenticated(t *testing.T) {
	w := newTLSWorld(t)
	if err := w.status(t, w.operator); err != nil {
		t.Fatalf("the operator's Status: %v", err)
	}
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{{"no certificate", w.none}, {"another CA", w.foreign}, {"expired", w.expired}} {
		t.Run(tc.name, func(t *testing.T) {
			if err := w.status(t, tc.cfg); err == nil {
				t.Error("control: Status answered")
			}
			for port, addr := range map[string]string{"control": w.control, "raft": w.raft, "data": w.data} {
				if err := handshake(addr, tc.cfg); err == nil {
					t.Errorf("%s port accepted the connection", port)
				}
			}
		})
	}
	for _, tc := range []struct {
		port, addr, who string
		cfg             *tls.Config
		ok              bool
	}{
		{"raft", w.raft, "server", w.peer, true},
		{"raft", w.raft, "operator", w.operator, false},
		{"raft", w.raft, "csi-node", w.node, false},
		{"data", w.data, "csi-node", w.node, true},
		{"data", w.data, "operator", w.operator, true},
		{"data", w.data, "server", w.peer, true},
		{"control", w.control, "csi-node", w.node, true},
	} {
		if err := handshake(tc.addr, tc.cfg); (err == nil) != tc.ok {
			t.Errorf("%s port, %s: %v, want accepted=%v", tc.port, tc.who, err, tc.ok)
		}
	}
}

// TestTLSRotatedServerCertificatePickedUp: a server's certificate replaced
// on disk is presented on every port within the reload interval, without
// a restart.
func TestTLSRotatedServerCertificatePickedUp(t *testing.T) {
	w := newTLSWorld(t)
	serials := func() map[string]string {
		out := map[string]string{}
		for port, addr := range map[string]string{"control": w.control, "raft": w.raft, "data": w.data} {
			cfg := w.peer.Clone()
			cfg.NextProtos = []string{"h2"}
			c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
			if err != nil {
				t.Fatalf("%s: %v", port, err)
			}
			out[port] = c.ConnectionState().PeerCertificates[0].SerialNumber.String()
			c.Close()
		}
		return out
	}
	before := serials()
	self := pki.Identity{Role: pki.RoleServer, Name: w.c.Nodes[0].ID}
	files := pki.LocalFiles(w.c.TLSDir(), self)
	if err := os.Remove(files.Cert); err != nil {
		t.Fatal(err)
	}
	w.c.TLSFiles(self) // issues a new pair
	deadline := time.Now().Add(10 * time.Second)
	for {
		after := serials()
		rotated := 0
		for port := range after {
			if after[port] != before[port] {
				rotated++
			}
		}
		if rotated == len(after) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("serials before %v, after %v: not every port presents the new certificate", before, after)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := w.status(t, w.operator); err != nil {
		t.Fatalf("Status after the rotation: %v", err)
	}
}

// TestDataPortOpenNeedsTheNodesCertificate: under TLS the data port knows
// who opens (the peer certificate), so naming the node a volume is
// attached to is not enough: a csi-node certificate of another node is
// refused even at the committed epoch, and the attached node's own
// certificate is granted.
func TestDataPortOpenNeedsTheNodesCertificate(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{TLS: true})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "mine", 1<<20, 3)
	ctx := ctxT(t, time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, bytes.Repeat([]byte("node-1's"), 512), 0, false); err != nil {
		t.Fatal(err)
	}
	v = getVolume(t, c, leader, v.Id)
	as := func(node string) *dataAttacker {
		a := newDataAttacker(t, c, leader, v)
		a.dial = c.TLSSource(pki.Identity{Role: pki.RoleCSINode, Name: node}).Dialer(nil, pki.RoleServer)
		return a
	}
	r := v.Replicas[0]
	open := func(a *dataAttacker, node string) error {
		_, err := a.open(ctx, wire.OpenRequest{Replica: r.Id, Volume: v.Id, Node: node, Epoch: v.Epoch, Purpose: wire.PurposeAttach})
		return err
	}
	if err := open(as("node-2"), "node-1"); !errors.Is(err, wire.ErrDenied) {
		t.Errorf("node-2's certificate opening node-1's volume as node-1: %v, want ErrDenied", err)
	}
	if err := open(as("node-2"), "node-2"); !errors.Is(err, wire.ErrDenied) {
		t.Errorf("node-2's certificate opening as itself a volume attached to node-1: %v, want ErrDenied", err)
	}
	if err := open(as("node-1"), "node-1"); err != nil {
		t.Errorf("node-1's own certificate opening its volume: %v, want granted", err)
	}
}
