package pki

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// SelfIssuer keeps a certificate for one identity in a directory, issued
// by a CA whose certificate and key this process was given: a stor-server
// in Kubernetes, which deploy/ gives cert-manager's stor-ca secret. A
// StatefulSet cannot mount a different Secret in each pod, and a server's
// identity must name its own id (stor://server/<pod name>); the servers
// hold the CA key anyway, to issue the CSI nodes their certificates, so
// each issues its own. The rest of the cluster sees an ordinary
// certificate of the CA.
//
// Issue writes Dir/tls.crt and Dir/tls.key (0600, each atomically) and
// returns the Files a Source loads, with CA the bundle file as given (the
// Source re-reads all three when they change: cert-manager rotates the
// bundle, Run the pair).
type SelfIssuer struct {
	ID            Identity
	CACert, CAKey string // the issuing CA's certificate and key (PEM)
	Bundle        string // the CA bundle peers are verified against
	Dir           string
	Validity      time.Duration // default DefaultSelfValidity
	// CheckEvery is how often Run looks at the certificate and the CA's
	// file. Default a minute.
	CheckEvery time.Duration
	Logger     *slog.Logger

	mu       sync.Mutex
	issuedCA string // fileStamp of CACert when the current pair was issued
}

// issueBackdate is how far before its issue a certificate's validity
// starts (clock skew between hosts).
const issueBackdate = 5 * time.Minute

// DefaultSelfValidity is how long a self-issued certificate lasts; Run
// renews it after two thirds of its lifetime.
const DefaultSelfValidity = 7 * 24 * time.Hour

// Files are the files Issue writes and the bundle.
func (s *SelfIssuer) Files() Files {
	return Files{Cert: filepath.Join(s.Dir, "tls.crt"), Key: filepath.Join(s.Dir, "tls.key"), CA: s.Bundle}
}

func (s *SelfIssuer) validity() time.Duration {
	if s.Validity > 0 {
		return s.Validity
	}
	return DefaultSelfValidity
}

// Issue issues a new certificate and key for ID now, re-reading the CA's
// files (cert-manager may have rotated them).
func (s *SelfIssuer) Issue() (Files, error) {
	if err := s.ID.Validate(); err != nil {
		return Files{}, err
	}
	stamp := fileStamp(s.CACert)
	ca, err := LoadCA(s.CACert, s.CAKey)
	if err != nil {
		return Files{}, fmt.Errorf("pki: the issuing CA: %w", err)
	}
	if !ca.Cert.IsCA {
		return Files{}, fmt.Errorf("pki: %s is not a CA certificate", s.CACert)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return Files{}, err
	}
	now := time.Now()
	notAfter := now.Add(s.validity())
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	cert, key, err := ca.Issue(s.ID, now.Add(-issueBackdate), notAfter)
	if err != nil {
		return Files{}, err
	}
	f := s.Files()
	// The key first: a Source that reloads between the two writes sees a
	// pair that does not match, keeps its previous one and retries.
	if err := writeFile(f.Key, key); err != nil {
		return Files{}, err
	}
	if err := writeFile(f.Cert, cert); err != nil {
		return Files{}, err
	}
	s.mu.Lock()
	s.issuedCA = stamp
	s.mu.Unlock()
	return f, nil
}

// caChanged reports whether the CA's certificate file is not the one the
// current pair was issued from (a pair Run did not issue counts as
// issued from another).
func (s *SelfIssuer) caChanged() bool {
	now := fileStamp(s.CACert)
	s.mu.Lock()
	defer s.mu.Unlock()
	return now != s.issuedCA
}

// Run renews the certificate until ctx ends: at two thirds of the
// lifetime of the certificate in Dir (read from the file, so a certificate
// capped by its CA's expiry is renewed in time), and whenever the CA's
// certificate file changes (cert-manager renewed the CA: the new pair must
// chain to it). It looks every CheckEvery (default a minute); a failed
// renewal is logged and retried at the next look.
func (s *SelfIssuer) Run(ctx context.Context) {
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	every := s.CheckEvery
	if every <= 0 {
		every = time.Minute
	}
	for {
		wait := every
		due, err := s.renewAt()
		if err == nil {
			wait = min(wait, time.Until(due))
		}
		t := time.NewTimer(max(wait, 0))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if err == nil && time.Now().Before(due) && !s.caChanged() {
			continue
		}
		if _, err := s.Issue(); err != nil {
			log.Error("renewing this server's certificate", "identity", s.ID.String(), "err", err)
			continue
		}
		log.Info("renewed this server's certificate", "identity", s.ID.String())
	}
}

// renewAt is when the certificate in Dir is due for renewal.
func (s *SelfIssuer) renewAt() (time.Time, error) {
	b, err := os.ReadFile(s.Files().Cert)
	if err != nil {
		return time.Time{}, err
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return time.Time{}, fmt.Errorf("pki: %s is not PEM", s.Files().Cert)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return time.Time{}, err
	}
	// Two thirds of the lifetime from the issue, not from the backdated
	// NotBefore (from there, a certificate shorter than about ten minutes,
	// one capped by its CA's expiry say, would be due at once, again and
	// again).
	issued := c.NotBefore.Add(issueBackdate)
	if !issued.Before(c.NotAfter) {
		issued = c.NotBefore
	}
	return issued.Add(c.NotAfter.Sub(issued) * 2 / 3), nil
}

// fileStamp is a file's size and modification time ("" if unreadable).
func fileStamp(name string) string {
	fi, err := os.Stat(name)
	if err != nil {
		return ""
	}
	return fmt.Sprint(fi.Size(), fi.ModTime().UnixNano())
}
