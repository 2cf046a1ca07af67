package pki

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"
)

// Files names a certificate, its key and the CA bundle that peers'
// certificates must chain to, all PEM.
type Files struct {
	Cert, Key, CA string
}

// Set reports whether any of the three is given.
func (f Files) Set() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// Validate reports a partial set.
func (f Files) Validate() error {
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return fmt.Errorf("pki: --tls-cert, --tls-key and --tls-ca are all needed (have %q, %q, %q)", f.Cert, f.Key, f.CA)
	}
	return nil
}

// ReloadInterval is how often, at most, a Source looks at its files.
const ReloadInterval = time.Second

// Source is a certificate, key and CA bundle read from Files and re-read
// when they change; see the package doc. It is safe for concurrent use.
type Source struct {
	files  Files
	logger *slog.Logger
	now    func() time.Time

	mu      sync.Mutex
	checked time.Time // when the files were last looked at
	stamps  [3]stamp
	cert    *tls.Certificate
	pool    *x509.CertPool
	caPEM   []byte // the bundle pool was made from
	self    Identity
}

type stamp struct {
	size int64
	mod  time.Time
}

// Load reads files; an error names what is wrong with them.
func Load(files Files, logger *slog.Logger) (*Source, error) {
	if err := files.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	s := &Source{files: files, logger: logger, now: time.Now}
	st, err := s.stat()
	if err != nil {
		return nil, err
	}
	if err := s.loadLocked(st); err != nil {
		return nil, err
	}
	return s, nil
}

// Identity is the identity in this source's own certificate.
func (s *Source) Identity() Identity {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.self
}

func (s *Source) stat() ([3]stamp, error) {
	var st [3]stamp
	for i, name := range []string{s.files.Cert, s.files.Key, s.files.CA} {
		fi, err := os.Stat(name)
		if err != nil {
			return st, fmt.Errorf("pki: %w", err)
		}
		st[i] = stamp{fi.Size(), fi.ModTime()}
	}
	return st, nil
}

func (s *Source) loadLocked(st [3]stamp) error {
	cert, err := tls.LoadX509KeyPair(s.files.Cert, s.files.Key)
	if err != nil {
		return fmt.Errorf("pki: %s, %s: %w", s.files.Cert, s.files.Key, err)
	}
	self, err := IdentityOf(cert.Leaf)
	if err != nil {
		return fmt.Errorf("pki: %s: %w", s.files.Cert, err)
	}
	caPEM, err := os.ReadFile(s.files.CA)
	if err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("pki: %s holds no PEM certificate", s.files.CA)
	}
	s.cert, s.pool, s.caPEM, s.self, s.stamps = &cert, pool, caPEM, self, st
	return nil
}

// CABundle is the CA bundle in use, PEM (re-read if its file changed).
func (s *Source) CABundle() []byte {
	s.current()
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.caPEM)
}

// current returns the certificate and pool, first re-reading the files if
// they changed (at most every ReloadInterval).
func (s *Source) current() (*tls.Certificate, *x509.CertPool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if now.Sub(s.checked) < ReloadInterval && !s.checked.IsZero() {
		return s.cert, s.pool
	}
	s.checked = now
	st, err := s.stat()
	if err != nil {
		s.logger.Warn("certificate files unreadable; keeping the loaded ones", "err", err)
		return s.cert, s.pool
	}
	if st != s.stamps {
		if err := s.loadLocked(st); err != nil {
			s.logger.Warn("certificate files changed but do not load; keeping the loaded ones", "err", err)
		} else {
			s.logger.Info("certificates reloaded", "cert", s.files.Cert, "identity", s.self.String(), "not_after", s.cert.Leaf.NotAfter)
		}
	}
	return s.cert, s.pool
}

// ServerConfig is the tls.Config of a listener that admits clients with
// one of roles (all roles if none is given).
func (s *Source) ServerConfig(roles ...Role) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ClientAuth: tls.RequireAnyClientCert, // verified below against the current pool
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			c, _ := s.current()
			return c, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, pool := s.current()
			_, err := verify(cs, pool, x509.ExtKeyUsageClientAuth, roles, s.now())
			return err
		},
	}
}

// ClientConfig is the tls.Config of a client of a listener whose
// certificate must carry one of roles (RoleServer if none is given).
func (s *Source) ClientConfig(roles ...Role) *tls.Config {
	if len(roles) == 0 {
		roles = []Role{RoleServer}
	}
	return &tls.Config{
		MinVersion:         tls.VersionTLS13,
		InsecureSkipVerify: true, // no host-name check; the chain and role are verified below
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			c, _ := s.current()
			return c, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, pool := s.current()
			_, err := verify(cs, pool, x509.ExtKeyUsageServerAuth, roles, s.now())
			return err
		},
	}
}

// verify checks the peer's chain against pool at now, with usage, and
// that its identity has one of roles (any role if roles is empty).
func verify(cs tls.ConnectionState, pool *x509.CertPool, usage x509.ExtKeyUsage, roles []Role, now time.Time) (Identity, error) {
	if len(cs.PeerCertificates) == 0 {
		return Identity{}, ErrNoPeer
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	leaf := cs.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots: pool, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{usage},
	}); err != nil {
		return Identity{}, fmt.Errorf("pki: peer certificate: %w", err)
	}
	id, err := IdentityOf(leaf)
	if err != nil {
		return Identity{}, err
	}
	if len(roles) > 0 && !slices.Contains(roles, id.Role) {
		return Identity{}, fmt.Errorf("%w: %s", ErrRole, id)
	}
	return id, nil
}

// PeerIdentity is the identity of the peer of a completed handshake made
// with a config from this package (which verified the chain).
func PeerIdentity(cs tls.ConnectionState) (Identity, error) {
	if !cs.HandshakeComplete || len(cs.PeerCertificates) == 0 {
		return Identity{}, ErrNoPeer
	}
	return IdentityOf(cs.PeerCertificates[0])
}

// ConnIdentity completes the handshake of conn if it is a *tls.Conn and
// returns the peer's identity; a plain connection (--insecure) returns
// ErrNoPeer.
func ConnIdentity(ctx context.Context, conn net.Conn) (Identity, error) {
	tc, ok := conn.(*tls.Conn)
	if !ok {
		return Identity{}, ErrNoPeer
	}
	if err := tc.HandshakeContext(ctx); err != nil {
		return Identity{}, err
	}
	return PeerIdentity(tc.ConnectionState())
}

// DialFunc opens a connection, as net.Dialer.DialContext.
type DialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// Dialer wraps dial so that it returns a TLS connection, handshake done,
// to a peer with one of roles (RoleServer if none is given).
func (s *Source) Dialer(dial DialFunc, roles ...Role) DialFunc {
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	cfg := s.ClientConfig(roles...)
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		raw, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		tc := tls.Client(raw, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, fmt.Errorf("pki: TLS handshake with %s: %w", addr, err)
		}
		return tc, nil
	}
}

// Listener wraps ln so that it accepts TLS connections from peers with one
// of roles (any role if none is given). The handshake runs on the first
// read or ConnIdentity.
func (s *Source) Listener(ln net.Listener, roles ...Role) net.Listener {
	return tls.NewListener(ln, s.ServerConfig(roles...))
}

// CheckLoopback returns ErrNotLoopback for the first address whose host is
// not a loopback IP or "localhost" (an empty host listens everywhere).
func CheckLoopback(addrs ...string) error {
	for _, a := range addrs {
		if a == "" {
			continue
		}
		host, _, err := net.SplitHostPort(a)
		if err != nil {
			host = a
		}
		if host == "localhost" {
			continue
		}
		if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
			continue
		}
		return fmt.Errorf("%w: %q", ErrNotLoopback, a)
	}
	return nil
}
