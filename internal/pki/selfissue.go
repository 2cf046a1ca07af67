package pki

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
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
	Logger        *slog.Logger
}

// DefaultSelfValidity is how long a self-issued certificate lasts; Run
// renews it after two thirds of that.
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
	cert, key, err := ca.Issue(s.ID, now.Add(-5*time.Minute), notAfter)
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
	return f, nil
}

// Run renews the certificate every two thirds of its validity until ctx
// ends; a failed renewal is logged and retried a minute later.
func (s *SelfIssuer) Run(ctx context.Context) {
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	wait := s.validity() * 2 / 3
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if _, err := s.Issue(); err != nil {
			log.Error("renewing this server's certificate", "identity", s.ID.String(), "err", err)
			wait = min(time.Minute, s.validity()/10)
			continue
		}
		log.Info("renewed this server's certificate", "identity", s.ID.String())
		wait = s.validity() * 2 / 3
	}
}
