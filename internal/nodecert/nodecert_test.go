package nodecert_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/nodecert"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// reviewer is a Kubernetes TokenReview API: token -> the node of the pod
// it is bound to. It records the tokens it was asked about.
type reviewer struct {
	nodes map[string]string
	mu    sync.Mutex
	seen  []string
}

func (r *reviewer) Review(_ context.Context, token string) (server.TokenReview, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, token)
	node, ok := r.nodes[token]
	if !ok {
		return server.TokenReview{Error: "invalid bearer token"}, nil
	}
	return server.TokenReview{
		Authenticated: true, Username: server.DefaultNodeServiceAccount, Audiences: []string{server.TokenAudience},
		Extra: map[string][]string{server.NodeNameExtra: {node}},
	}, nil
}

func (r *reviewer) tokens() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

// world is a one-server TLS cluster issuing node certificates valid for
// validity, and a node plugin's bootstrap credentials for it.
type world struct {
	c      *servertest.Cluster
	rev    *reviewer
	issuer nodecert.Issuer
	token  string // the token file
}

func newWorld(t *testing.T, validity time.Duration) *world {
	rev := &reviewer{nodes: map[string]string{"token-a": "worker-1", "token-b": "worker-1"}}
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true, Configure: func(_ int, cfg *server.Config) {
		dir := servertest.TLSDirOf(*cfg)
		cfg.NodeCerts = server.NodeCertConfig{
			IssuerCert: filepath.Join(dir, "ca.crt"), IssuerKey: filepath.Join(dir, "ca.key"),
			Validity: validity, Reviewer: rev,
		}
	}})
	boot := c.TLSSource(pki.Identity{Role: pki.RoleCSINodeBootstrap, Name: "stor-csi-node"})
	cl, err := client.Dial([]string{c.Nodes[0].Addr}, boot.GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	w := &world{c: c, rev: rev, issuer: cl.Cluster, token: filepath.Join(t.TempDir(), "token")}
	w.setToken(t, "token-a")
	return w
}

func (w *world) setToken(t *testing.T, token string) {
	t.Helper()
	if err := os.WriteFile(w.token, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func (w *world) bootstrapper(t *testing.T, node, dir string) *nodecert.Bootstrapper {
	t.Helper()
	b, err := nodecert.New(nodecert.Config{
		NodeID: node, Dir: dir, TokenFile: w.token, Issuer: w.issuer,
		RetryMin: 50 * time.Millisecond, RetryMax: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// serial is the serial of the certificate in dir.
func serial(t *testing.T, dir string) string {
	t.Helper()
	return leaf(t, dir).SerialNumber.String()
}

// TestBootstrapWritesAndRenews: Ensure obtains worker-1's certificate with
// the bootstrap credentials and writes it, its key and the bundle 0600;
// they load as stor://csi-node/worker-1 and are accepted by the cluster;
// Ensure again keeps them; Run renews before expiry, with the token file
// as it is then (kubelet rotates it), and a Source on the files picks the
// new certificate up.
func TestBootstrapWritesAndRenews(t *testing.T) {
	w := newWorld(t, 6*time.Second)
	dir := filepath.Join(t.TempDir(), "tls")
	b := w.bootstrapper(t, "worker-1", dir)
	ctx := ctxT(t, time.Minute)
	if err := b.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	f := b.Files()
	for _, name := range []string{f.Cert, f.Key, f.CA} {
		fi, err := os.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", name, fi.Mode().Perm())
		}
	}
	src, err := pki.Load(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := src.Identity(); got != (pki.Identity{Role: pki.RoleCSINode, Name: "worker-1"}) {
		t.Fatalf("written certificate is %s", got)
	}
	first, firstExpiry := serial(t, dir), leaf(t, dir).NotAfter
	// The cluster accepts it: a node's call.
	cl, err := client.Dial([]string{w.c.Nodes[0].Addr}, src.GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.Cluster.Status(ctx, &storpb.StatusRequest{}); err != nil {
		t.Fatalf("Status with the obtained certificate: %v", err)
	}
	if err := b.Ensure(ctx); err != nil || serial(t, dir) != first || len(w.rev.tokens()) != 1 {
		t.Fatalf("Ensure with a fresh certificate: %v, serial %s (was %s), %d token reviews; want it kept", err, serial(t, dir), first, len(w.rev.tokens()))
	}

	w.setToken(t, "token-b") // kubelet rotated the token
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(rctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for serial(t, dir) == first {
		if time.Now().After(deadline) {
			t.Fatal("no renewal within 20s of a 6s certificate")
		}
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run after cancel: %v", err)
	}
	if toks := w.rev.tokens(); toks[len(toks)-1] != "token-b" {
		t.Errorf("renewal presented %q, want the token file's current token-b", toks)
	}
	// After the first certificate expired, a new connection through the
	// Source on the files presents the renewed one and is accepted.
	time.Sleep(time.Until(firstExpiry.Add(500 * time.Millisecond)))
	cl2, err := client.Dial([]string{w.c.Nodes[0].Addr}, src.GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	defer cl2.Close()
	if _, err := cl2.Cluster.Status(ctxT(t, 10*time.Second), &storpb.StatusRequest{}); err != nil {
		t.Errorf("Status on a new connection after the first certificate expired: %v", err)
	}
}

// leaf is the certificate in dir.
func leaf(t *testing.T, dir string) *x509.Certificate {
	t.Helper()
	f := nodecert.Files(dir)
	pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	return pair.Leaf
}

// TestBootstrapRefusesAnotherNode: a pod whose token is bound to worker-1
// but which runs with --node-id worker-2 gets worker-1's certificate from
// the cluster; the Bootstrapper refuses it with ErrWrongNode and writes
// nothing.
func TestBootstrapRefusesAnotherNode(t *testing.T) {
	w := newWorld(t, time.Hour)
	dir := filepath.Join(t.TempDir(), "tls")
	err := w.bootstrapper(t, "worker-2", dir).Ensure(ctxT(t, time.Minute))
	if !errors.Is(err, nodecert.ErrWrongNode) || !strings.Contains(err.Error(), "stor://csi-node/worker-1") {
		t.Fatalf("Ensure as worker-2 with worker-1's token: %v, want ErrWrongNode naming worker-1", err)
	}
	if _, err := os.Stat(nodecert.Files(dir).Cert); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a certificate was written: %v", err)
	}
}
