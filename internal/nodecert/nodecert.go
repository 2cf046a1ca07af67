// Package nodecert is the node plugin's side of node certificates: it
// obtains from the cluster a certificate naming its own Kubernetes node
// (stor://csi-node/<node>), keeps it in a directory that a pki.Source
// reads, and renews it before it expires. The server's side, and why, is
// in package server (nodecert.go) and package pki's doc.
//
// # The flow
//
// The node plugin pod holds a bootstrap certificate
// (stor://csi-node-bootstrap/…, the same for every node plugin pod) and a
// projected ServiceAccount token for audience "stor", which kubelet binds
// to the pod and rotates. To obtain a certificate a Bootstrapper makes a
// new ECDSA P-256 key (it never leaves the node: only a CSR for it is
// sent), reads the token file afresh, and calls
// ClusterService.IssueNodeCertificate over a connection authenticated by
// the bootstrap certificate. The server decides the node from the token
// review; the Bootstrapper refuses a certificate that is not for
// Config.NodeID (the pod's node and --node-id disagree), not for its key,
// or that does not chain to the returned CA bundle, and writes nothing
// then.
//
// # Files
//
// Config.Dir (an emptyDir: the key is never persisted beyond the pod)
// holds CertFile (the certificate and any intermediates), KeyFile and
// CAFile (the bundle the servers' certificates chain to), each 0600 and
// replaced atomically by a rename, the bundle first, then the key, then the
// certificate. A pki.Source reading them may see the new key with the old
// certificate for an instant; it then keeps its loaded pair and loads the
// new one at its next look (pki's rotation rules).
//
// # Renewal
//
// A certificate is renewed once RenewAfter (2/3) of its lifetime has
// passed; Ensure, at start, obtains one unless Dir holds a valid
// certificate for NodeID before its renewal time, and Run renews in the
// background until its context ends, retrying a failed renewal with
// capped exponential backoff while the current certificate lasts (and
// after: a node whose certificate expired keeps asking).
package nodecert

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
)

// The files a Bootstrapper writes in Config.Dir.
const (
	CertFile = "tls.crt"
	KeyFile  = "tls.key"
	CAFile   = "ca.crt"
)

// Issuer is the call that issues node certificates (a
// storpb.ClusterServiceClient over the bootstrap certificate).
type Issuer interface {
	IssueNodeCertificate(ctx context.Context, in *storpb.IssueNodeCertificateRequest, opts ...grpc.CallOption) (*storpb.IssueNodeCertificateResponse, error)
}

// Config configures a Bootstrapper.
type Config struct {
	// NodeID is the node the certificate must name (stor-csi --node-id).
	// Required.
	NodeID string
	// Dir receives CertFile, KeyFile and CAFile; created 0700. Required.
	Dir string
	// TokenFile holds the pod's ServiceAccount token (audience "stor"),
	// re-read for every request (kubelet rotates it). Required.
	TokenFile string
	// Issuer is the cluster, reached with the bootstrap certificate.
	// Required.
	Issuer Issuer
	// RenewAfter is the fraction of a certificate's lifetime after which
	// it is renewed. Default 2/3.
	RenewAfter float64
	// RetryMin and RetryMax bound the backoff between failed renewals.
	// Defaults 1s and 1m.
	RetryMin, RetryMax time.Duration
	// Logger receives structured logs. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Files are the certificate files in dir, for pki.Load.
func Files(dir string) pki.Files {
	return pki.Files{Cert: filepath.Join(dir, CertFile), Key: filepath.Join(dir, KeyFile), CA: filepath.Join(dir, CAFile)}
}

// ErrWrongNode: the cluster issued a certificate for another node than
// Config.NodeID.
var ErrWrongNode = errors.New("nodecert: the pod's node and --node-id disagree")

// Bootstrapper obtains and renews the node's certificate; see the package
// doc. Ensure and Run are not to be called concurrently.
type Bootstrapper struct {
	cfg    Config
	id     pki.Identity
	logger *slog.Logger
}

// New validates cfg.
func New(cfg Config) (*Bootstrapper, error) {
	if cfg.RenewAfter == 0 {
		cfg.RenewAfter = 2.0 / 3
	}
	if cfg.RetryMin == 0 {
		cfg.RetryMin = time.Second
	}
	if cfg.RetryMax == 0 {
		cfg.RetryMax = time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	id := pki.Identity{Role: pki.RoleCSINode, Name: cfg.NodeID}
	switch {
	case id.Validate() != nil:
		return nil, fmt.Errorf("nodecert: --node-id: %w", id.Validate())
	case cfg.Dir == "":
		return nil, fmt.Errorf("nodecert: --tls-dir is required")
	case cfg.TokenFile == "":
		return nil, fmt.Errorf("nodecert: --token-file is required")
	case cfg.Issuer == nil:
		return nil, fmt.Errorf("nodecert: no cluster to ask")
	case cfg.RenewAfter <= 0 || cfg.RenewAfter >= 1:
		return nil, fmt.Errorf("nodecert: renew after %v of the lifetime: want a fraction in (0, 1)", cfg.RenewAfter)
	case cfg.RetryMin <= 0 || cfg.RetryMax < cfg.RetryMin:
		return nil, fmt.Errorf("nodecert: retry backoff %v..%v", cfg.RetryMin, cfg.RetryMax)
	}
	return &Bootstrapper{cfg: cfg, id: id, logger: cfg.Logger.With("node", cfg.NodeID)}, nil
}

// Files are the certificate files Ensure and Run keep.
func (b *Bootstrapper) Files() pki.Files { return Files(b.cfg.Dir) }

// Ensure makes Dir hold a valid certificate for NodeID. It keeps the one
// there before its renewal time; otherwise it obtains one. A certificate
// past its renewal time but still valid is kept if a new one cannot be
// had (Run will keep trying).
func (b *Bootstrapper) Ensure(ctx context.Context) error {
	leaf, err := b.current()
	if err == nil && b.cfg.Now().Before(b.renewAt(leaf)) {
		b.logger.Info("node certificate present", "not_after", leaf.NotAfter)
		return nil
	}
	if err != nil {
		b.logger.Info("obtaining a node certificate", "reason", err)
	}
	ierr := b.issue(ctx)
	if ierr != nil && err == nil && b.cfg.Now().Before(leaf.NotAfter) {
		b.logger.Warn("node certificate due for renewal, renewal failed; keeping it", "not_after", leaf.NotAfter, "err", ierr)
		return nil
	}
	return ierr
}

// Run renews the certificate at its renewal time until ctx ends, and
// returns ctx's error.
func (b *Bootstrapper) Run(ctx context.Context) error {
	backoff := b.cfg.RetryMin
	for {
		wait := time.Duration(0)
		if leaf, err := b.current(); err == nil {
			wait = b.renewAt(leaf).Sub(b.cfg.Now())
		} else {
			b.logger.Warn("node certificate unusable; renewing now", "err", err)
		}
		if err := sleep(ctx, wait); err != nil {
			return err
		}
		if err := b.issue(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			b.logger.Error("node certificate renewal failed; retrying", "err", err, "retry_in", backoff)
			if err := sleep(ctx, backoff); err != nil {
				return err
			}
			backoff = min(2*backoff, b.cfg.RetryMax)
			continue
		}
		backoff = b.cfg.RetryMin
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// renewAt is when leaf is due for renewal.
func (b *Bootstrapper) renewAt(leaf *x509.Certificate) time.Time {
	life := leaf.NotAfter.Sub(leaf.NotBefore)
	return leaf.NotBefore.Add(time.Duration(float64(life) * b.cfg.RenewAfter))
}

// current returns the certificate in Dir if it is a valid certificate of
// NodeID for its key, chaining to the bundle beside it, at Now.
func (b *Bootstrapper) current() (*x509.Certificate, error) {
	f := b.Files()
	pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, err
	}
	bundle, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, err
	}
	if err := b.check(pair.Certificate, bundle); err != nil {
		return nil, err
	}
	return pair.Leaf, nil
}

// check verifies chain (DER, leaf first) against bundle at Now, for client
// authentication, and that it names NodeID.
func (b *Bootstrapper) check(chain [][]byte, bundle []byte) error {
	certs := make([]*x509.Certificate, len(chain))
	for i, der := range chain {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return fmt.Errorf("nodecert: certificate: %w", err)
		}
		certs[i] = c
	}
	if len(certs) == 0 {
		return fmt.Errorf("nodecert: no certificate")
	}
	leaf := certs[0]
	id, err := pki.IdentityOf(leaf)
	if err != nil {
		return err
	}
	if id != b.id {
		return fmt.Errorf("%w: the certificate is %s, --node-id %q needs %s", ErrWrongNode, id, b.cfg.NodeID, b.id)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(bundle) {
		return fmt.Errorf("nodecert: the CA bundle holds no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots: roots, Intermediates: inter, CurrentTime: b.cfg.Now(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}); err != nil {
		return fmt.Errorf("nodecert: certificate for %s: %w", id, err)
	}
	return nil
}

// issue obtains a certificate for a new key and writes it to Dir.
func (b *Bootstrapper) issue(ctx context.Context) error {
	token, err := os.ReadFile(b.cfg.TokenFile)
	if err != nil {
		return fmt.Errorf("nodecert: --token-file: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	csrDER, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: b.cfg.NodeID},
	}, key)
	if err != nil {
		return err
	}
	resp, err := b.cfg.Issuer.IssueNodeCertificate(ctx, &storpb.IssueNodeCertificateRequest{
		Token: strings.TrimSpace(string(token)),
		Csr:   pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csrDER}),
	})
	if err != nil {
		return fmt.Errorf("nodecert: IssueNodeCertificate: %w", err)
	}
	var chain [][]byte
	for rest := resp.CertificateChain; ; {
		var blk *pem.Block
		if blk, rest = pem.Decode(rest); blk == nil {
			break
		}
		if blk.Type == "CERTIFICATE" {
			chain = append(chain, blk.Bytes)
		}
	}
	if err := b.check(chain, resp.CaBundle); err != nil {
		return err
	}
	leaf, _ := x509.ParseCertificate(chain[0])
	if pub, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || !pub.Equal(&key.PublicKey) {
		return fmt.Errorf("nodecert: the issued certificate is not for the key this node sent")
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	f := b.Files()
	if err := os.MkdirAll(b.cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("nodecert: --tls-dir: %w", err)
	}
	for _, w := range []struct {
		name string
		data []byte
	}{
		{f.CA, resp.CaBundle},
		{f.Key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})},
		{f.Cert, resp.CertificateChain},
	} {
		if err := writeAtomic(w.name, w.data); err != nil {
			return fmt.Errorf("nodecert: %w", err)
		}
	}
	b.logger.Info("node certificate obtained", "identity", b.id.String(), "serial", leaf.SerialNumber.Text(16),
		"not_after", leaf.NotAfter, "renew_at", b.renewAt(leaf))
	return nil
}

// writeAtomic writes data to name (0600) through a temporary file in the
// same directory, synced, then renamed over name.
func writeAtomic(name string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename, nothing to remove
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), name)
}
