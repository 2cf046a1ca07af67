package server_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/wire"
)

// fakeReviewer is a Kubernetes TokenReview API that knows a fixed set of
// tokens; any other token does not authenticate.
type fakeReviewer map[string]server.TokenReview

func (f fakeReviewer) Review(_ context.Context, token string) (server.TokenReview, error) {
	if r, ok := f[token]; ok {
		return r, nil
	}
	return server.TokenReview{Error: "invalid bearer token"}, nil
}

// podToken is the review of a token of the node plugin's ServiceAccount
// bound to a pod on node.
func podToken(node string) server.TokenReview {
	return server.TokenReview{
		Authenticated: true,
		Username:      server.DefaultNodeServiceAccount,
		Audiences:     []string{server.TokenAudience},
		Extra: map[string][]string{
			server.NodeNameExtra:                         {node},
			"authentication.kubernetes.io/pod-name":      {"stor-csi-node-" + node},
			"authentication.kubernetes.io/credential-id": {"JTI=x"},
		},
	}
}

var reviews = fakeReviewer{
	"token-w1": podToken("worker-1"),
	"token-w2": podToken("worker-2"),
	"token-other-sa": func() server.TokenReview {
		r := podToken("worker-1")
		r.Username = "system:serviceaccount:default:builder"
		return r
	}(),
	"token-no-node": func() server.TokenReview {
		r := podToken("worker-1")
		delete(r.Extra, server.NodeNameExtra)
		return r
	}(),
	"token-other-audience": func() server.TokenReview {
		r := podToken("worker-1")
		r.Audiences = nil // valid for the API server, not for stor
		return r
	}(),
}

// csrFor makes a key and a CSR for it that claims to be names (which the
// server must ignore).
func csrFor(t *testing.T, names ...string) (*ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.CertificateRequest{Subject: pkix.Name{CommonName: "claimed"}}
	for _, n := range names {
		u, err := url.Parse(n)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, u)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

// loadIssued writes an issued certificate, its key and bundle to files and
// loads them.
func loadIssued(t *testing.T, key *ecdsa.PrivateKey, resp *storpb.IssueNodeCertificateResponse) *pki.Source {
	t.Helper()
	dir := t.TempDir()
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	f := pki.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}
	for name, data := range map[string][]byte{
		f.Cert: resp.CertificateChain, f.CA: resp.CaBundle,
		f.Key: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}),
	} {
		if err := os.WriteFile(name, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	src, err := pki.Load(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// clientsOf returns control API clients of node i presenting src's
// certificate.
func clientsOf(t *testing.T, c *servertest.Cluster, i int, src *pki.Source) (servertest.Clients, *grpc.ClientConn) {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+c.Nodes[i].Addr, src.GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return servertest.Clients{
		Cluster:   storpb.NewClusterServiceClient(conn),
		Volumes:   storpb.NewVolumeServiceClient(conn),
		Snapshots: storpb.NewSnapshotServiceClient(conn),
	}, conn
}

// nodeCertCluster is a TLS cluster whose first two servers issue node
// certificates with the cluster CA, reviewing tokens with reviews; the
// third has no issuing CA.
func nodeCertCluster(t *testing.T, validity time.Duration, audit *[]string, mu *sync.Mutex) *servertest.Cluster {
	return servertest.NewCluster(t, servertest.Options{TLS: true, Configure: func(i int, cfg *server.Config) {
		if audit != nil {
			cfg.Logger = slog.New(auditLog{cfg.Logger.Handler(), mu, audit})
		}
		if i == 2 {
			return
		}
		dir := servertest.TLSDirOf(*cfg)
		cfg.NodeCerts = server.NodeCertConfig{
			IssuerCert: filepath.Join(dir, "ca.crt"), IssuerKey: filepath.Join(dir, "ca.key"),
			Validity: validity, Reviewer: reviews,
		}
	}})
}

var bootstrapID = pki.Identity{Role: pki.RoleCSINodeBootstrap, Name: "stor-csi-node"}

// TestIssueNodeCertificate: a bootstrap certificate with a pod-bound
// token of the node plugin's ServiceAccount gets a certificate for the
// node the token review names (never what the CSR claims), from the leader
// or a follower, audit-logged; every other token is refused with the
// right code; a server without an issuing CA says so; the issued
// certificate may renew itself but not get another node's.
func TestIssueNodeCertificate(t *testing.T) {
	var mu sync.Mutex
	var audit []string
	c := nodeCertCluster(t, time.Hour, &audit, &mu)
	leader := c.Leader(10 * time.Second)
	follower := 0
	if leader == 0 {
		follower = 1
	}
	ctx := ctxT(t, time.Minute)
	for _, at := range []int{leader, follower} {
		boot := as(t, c, at, bootstrapID)
		key, csr := csrFor(t, "stor://csi-node/worker-2", "stor://server/s1", "stor://operator/root")
		resp, err := boot.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w1", Csr: csr})
		if err != nil {
			t.Fatalf("server %d: issue with worker-1's token: %v", at, err)
		}
		src := loadIssued(t, key, resp)
		if got, want := src.Identity(), (pki.Identity{Role: pki.RoleCSINode, Name: "worker-1"}); got != want || resp.Node != "worker-1" {
			t.Fatalf("server %d: issued %s (node %q), want %s", at, got, resp.Node, want)
		}
		b, _ := pem.Decode(resp.CertificateChain)
		leaf, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if len(leaf.URIs) != 1 || len(leaf.ExtKeyUsage) != 1 || leaf.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth {
			t.Errorf("issued certificate: URIs %v, usages %v; want one URI, client authentication only", leaf.URIs, leaf.ExtKeyUsage)
		}
		if life := leaf.NotAfter.Sub(time.Now()); life > time.Hour || life < 50*time.Minute {
			t.Errorf("issued certificate lasts %v more, want about the configured hour", life)
		}

		for _, tc := range []struct {
			token string
			want  codes.Code
		}{
			{"token-other-sa", codes.PermissionDenied},
			{"token-no-node", codes.PermissionDenied},
			{"token-other-audience", codes.Unauthenticated},
			{"token-unknown", codes.Unauthenticated},
			{"", codes.Unauthenticated},
		} {
			_, csr := csrFor(t)
			_, err := boot.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: tc.token, Csr: csr})
			wantCode(t, "issue with "+tc.token, err, tc.want)
		}
		_, err = boot.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w1", Csr: []byte("not a CSR")})
		wantCode(t, "issue for a malformed CSR", err, codes.InvalidArgument)

		// The node renews its own certificate, not another node's.
		n1, _ := clientsOf(t, c, at, src)
		key2, csr2 := csrFor(t)
		renewed, err := n1.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w1", Csr: csr2})
		if err != nil {
			t.Fatalf("worker-1 renews: %v", err)
		}
		if got := loadIssued(t, key2, renewed).Identity(); got.Name != "worker-1" {
			t.Errorf("renewal issued %s", got)
		}
		_, err = n1.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w2", Csr: csr2})
		wantCode(t, "worker-1's certificate gets worker-2's", err, codes.PermissionDenied)
	}
	_, csr := csrFor(t)
	_, err := as(t, c, 2, bootstrapID).Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w1", Csr: csr})
	wantCode(t, "issue at a server without an issuing CA", err, codes.FailedPrecondition)
	if err == nil || !strings.Contains(err.Error(), "--node-issuer-cert") {
		t.Errorf("without an issuing CA: %v, want a message naming --node-issuer-cert", err)
	}

	mu.Lock()
	defer mu.Unlock()
	issued := 0
	for _, rec := range audit {
		if strings.Contains(rec, "node certificate issued") && strings.Contains(rec, "node=worker-1") &&
			strings.Contains(rec, "identity=stor://csi-node-bootstrap/stor-csi-node") {
			issued++
		}
	}
	if issued != 2 {
		t.Errorf("audit log: %d issuances to the bootstrap identity for worker-1, want 2:\n%s", issued, strings.Join(audit, "\n"))
	}
}

// TestBootstrapCertificateOnlyIssues: the bootstrap certificate, shared by
// every node plugin pod, can call nothing but IssueNodeCertificate: no
// other control API method, no Raft, no data port; the certificate it
// obtains attaches and opens only its own node's volumes.
func TestBootstrapCertificateOnlyIssues(t *testing.T) {
	c := nodeCertCluster(t, time.Hour, nil, nil)
	leader := c.Leader(10 * time.Second)
	ctx := ctxT(t, time.Minute)
	ctl := as(t, c, leader, pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"})
	mine := createVolume(t, ctl, "mine", 1<<20, 3)
	theirs := createVolume(t, ctl, "theirs", 1<<20, 3)
	for v, node := range map[*storpb.Volume]string{mine: "worker-1", theirs: "worker-2"} {
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return ctl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: node})
		})
	}

	boot := as(t, c, leader, bootstrapID)
	ref := &storpb.VolumeRef{Id: mine.Id}
	for what, call := range map[string]func() error{
		"Status":      func() error { _, err := boot.Cluster.Status(ctx, &storpb.StatusRequest{}); return err },
		"ListServers": func() error { _, err := boot.Cluster.ListServers(ctx, &storpb.ListServersRequest{}); return err },
		"RegisterNode": func() error {
			_, err := boot.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: "worker-1"}})
			return err
		},
		"Join": func() error {
			_, err := boot.Cluster.Join(ctx, &storpb.JoinRequest{Server: &storpb.Server{Id: "stor-csi-node", Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:2"}})
			return err
		},
		"CreateVolume": func() error {
			_, err := boot.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "boot", SizeBytes: 1 << 20})
			return err
		},
		"GetVolume": func() error { _, err := boot.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: ref}); return err },
		"AttachVolume": func() error {
			_, err := boot.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: ref, NodeId: "worker-1", RequireAttached: true})
			return err
		},
		"DetachVolume": func() error {
			_, err := boot.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: ref, NodeId: "worker-1"})
			return err
		},
		"DeleteVolume": func() error {
			_, err := boot.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: ref})
			return err
		},
		"ListSnapshots": func() error {
			_, err := boot.Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{})
			return err
		},
		"WatchVolume": func() error {
			st, err := boot.Volumes.WatchVolume(ctx, &storpb.WatchVolumeRequest{Volume: ref})
			if err != nil {
				return err
			}
			_, err = st.Recv()
			return err
		},
	} {
		wantCode(t, "bootstrap certificate calls "+what, call(), codes.PermissionDenied)
	}
	bootSrc := c.TLSSource(bootstrapID)
	_, conn := clientsOf(t, c, leader, bootSrc)
	_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	wantCode(t, "bootstrap certificate checks health", err, codes.PermissionDenied)

	// The Raft and data ports refuse the bootstrap role at the handshake,
	// and no replica opens for it.
	for port, addr := range map[string]string{"raft": c.Nodes[leader].RaftAddr, "data": c.Nodes[leader].DataAddr} {
		if err := handshake(addr, bootSrc.ClientConfig()); err == nil {
			t.Errorf("%s port accepted the bootstrap certificate", port)
		}
	}
	mine = getVolume(t, c, leader, mine.Id)
	a := newDataAttacker(t, c, leader, mine)
	a.dial = bootSrc.Dialer(nil, pki.RoleServer)
	r := mine.Replicas[0]
	if _, err := a.open(ctx, wire.OpenRequest{Replica: r.Id, Volume: mine.Id, Node: "worker-1", Epoch: mine.Epoch, Purpose: wire.PurposeAttach}); err == nil {
		t.Error("the bootstrap certificate opened worker-1's replica")
	}

	// The certificate it obtains is worker-1's, and only worker-1's.
	key, csr := csrFor(t)
	resp := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.IssueNodeCertificateResponse, error) {
		return boot.Cluster.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{Token: "token-w1", Csr: csr})
	})
	w1Src := loadIssued(t, key, resp)
	w1, _ := clientsOf(t, c, leader, w1Src)
	re := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
		return w1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: mine.Id}, NodeId: "worker-1", RequireAttached: true})
	})
	_, err = w1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: theirs.Id}, NodeId: "worker-2", RequireAttached: true})
	wantCode(t, "worker-1's issued certificate attaches worker-2's volume", err, codes.PermissionDenied)
	_, err = w1.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: theirs.Id}})
	wantCode(t, "worker-1's issued certificate deletes a volume", err, codes.PermissionDenied)

	open := func(v *storpb.Volume, node string) error {
		a := newDataAttacker(t, c, leader, v)
		a.dial = w1Src.Dialer(nil, pki.RoleServer)
		r := v.Replicas[0]
		_, err := a.open(ctx, wire.OpenRequest{Replica: r.Id, Volume: v.Id, Node: node, Epoch: v.Epoch, Purpose: wire.PurposeAttach})
		return err
	}
	if err := open(re.Volume, "worker-1"); err != nil {
		t.Errorf("worker-1's issued certificate opening its volume: %v, want granted", err)
	}
	theirs = getVolume(t, c, leader, theirs.Id)
	if err := open(theirs, "worker-2"); !errors.Is(err, wire.ErrDenied) {
		t.Errorf("worker-1's issued certificate opening worker-2's volume: %v, want ErrDenied", err)
	}
}

// TestNodeIssuerMustBeTrusted: a server refuses to start with an issuing
// CA its own CA bundle does not trust (the certificates it issued would be
// refused everywhere), and with one but no TLS.
func TestNodeIssuerMustBeTrusted(t *testing.T) {
	other, err := pki.NewCA("other", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	if err := os.WriteFile(cert, other.CertPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, other.KeyPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true})
	cfg := servertest.TestConfig()
	cfg.ID, cfg.DataDir = "s9", t.TempDir()
	cfg.Listen, cfg.RaftListen, cfg.DataListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.TLS, cfg.Insecure = c.TLSSource(pki.Identity{Role: pki.RoleServer, Name: "s9"}), false
	cfg.NodeCerts = server.NodeCertConfig{IssuerCert: cert, IssuerKey: key, Reviewer: reviews}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "not trusted by --tls-ca") {
		t.Errorf("an issuing CA of another CA: %v, want refused as not trusted", err)
	}
	ca := c.TLSDir()
	cfg.NodeCerts.IssuerCert, cfg.NodeCerts.IssuerKey = filepath.Join(ca, "ca.crt"), filepath.Join(ca, "ca.key")
	if err := cfg.Validate(); err != nil {
		t.Errorf("the cluster CA as issuer: %v", err)
	}
	cfg.TLS, cfg.Insecure = nil, true
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "need TLS") {
		t.Errorf("an issuing CA without TLS: %v, want refused", err)
	}
}
