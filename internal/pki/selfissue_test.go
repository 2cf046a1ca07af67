package pki

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func certOf(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s is not PEM", file)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// A server given its CA's certificate and key issues its own certificate,
// which peers of that CA accept as stor://server/<id>, and renews it.
func TestSelfIssuer(t *testing.T) {
	w := newWorld(t)
	caCert, caKey := filepath.Join(w.dir, "issuer.crt"), filepath.Join(w.dir, "issuer.key")
	if err := writeFile(caCert, w.ca.CertPEM()); err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caKey, w.ca.KeyPEM()); err != nil {
		t.Fatal(err)
	}
	id := Identity{RoleServer, "stor-server-1"}
	si := &SelfIssuer{ID: id, CACert: caCert, CAKey: caKey, Bundle: w.bundle, Dir: filepath.Join(w.dir, "self"), Validity: 1500 * time.Millisecond,
		CheckEvery: 50 * time.Millisecond, Logger: testLogger(t)}
	f, err := si.Issue()
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(f.Key); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file %v (%v), want mode 0600", fi, err)
	}
	src, err := Load(f, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if src.Identity() != id {
		t.Fatalf("self-issued identity %v, want %v", src.Identity(), id)
	}
	cli := w.source(t, w.ca, Identity{RoleOperator, "admin"}, time.Now().Add(-time.Minute), time.Now().Add(time.Hour))
	addr, _, _ := serve(t, src.ServerConfig())
	if err := dialWith(addr, cli.ClientConfig()); err != nil {
		t.Fatalf("a client of the same CA refused the self-issued certificate: %v", err)
	}
	// The CA's validity bounds the certificate's (the world's CA lasts an hour).
	long := &SelfIssuer{ID: id, CACert: caCert, CAKey: caKey, Bundle: w.bundle, Dir: filepath.Join(w.dir, "long"), Validity: 48 * time.Hour}
	lf, err := long.Issue()
	if err != nil {
		t.Fatal(err)
	}
	if na := certOf(t, lf.Cert).NotAfter; na.After(w.ca.Cert.NotAfter) {
		t.Fatalf("certificate valid until %v, after its CA (%v)", na, w.ca.Cert.NotAfter)
	}

	// Run renews at two thirds of the validity: a new serial within 3 s.
	before := certOf(t, f.Cert).SerialNumber
	run := func() (stop func()) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { si.Run(ctx); close(done) }()
		return func() { cancel(); <-done }
	}
	stop := run()
	deadline := time.Now().Add(3 * time.Second)
	for certOf(t, f.Cert).SerialNumber.Cmp(before) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the certificate was not renewed within 3 s (validity 1.5 s)")
		}
		time.Sleep(50 * time.Millisecond)
	}

	// A new CA (cert-manager renewed it): the pair is issued again from it
	// at once, not at the old certificate's renewal time.
	stop()
	si.Validity = time.Hour
	if _, err := si.Issue(); err != nil {
		t.Fatal(err)
	}
	stop = run()
	defer stop()
	newCA, err := NewCA("renewed CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caKey, newCA.KeyPEM()); err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caCert, newCA.CertPEM()); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(3 * time.Second)
	for certOf(t, f.Cert).CheckSignatureFrom(newCA.Cert) != nil {
		if time.Now().After(deadline) {
			t.Fatal("not issued from the renewed CA within 3 s")
		}
		time.Sleep(50 * time.Millisecond)
	}

	// A leaf certificate cannot issue.
	leaf := issue(t, w.ca, w.dir, Identity{RoleOperator, "x"}, time.Now().Add(-time.Minute), time.Now().Add(time.Hour), w.bundle)
	bad := &SelfIssuer{ID: id, CACert: leaf.Cert, CAKey: leaf.Key, Bundle: w.bundle, Dir: filepath.Join(w.dir, "bad")}
	if _, err := bad.Issue(); err == nil || !strings.Contains(err.Error(), "not a CA") {
		t.Fatalf("issuing from a leaf certificate: %v, want an error", err)
	}
}

// selfIssuerOf writes w's CA to files and returns a SelfIssuer of it.
func selfIssuerOf(t *testing.T, w *world, validity time.Duration) (*SelfIssuer, string, string) {
	t.Helper()
	caCert, caKey := filepath.Join(w.dir, "issuer.crt"), filepath.Join(w.dir, "issuer.key")
	if err := writeFile(caCert, w.ca.CertPEM()); err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caKey, w.ca.KeyPEM()); err != nil {
		t.Fatal(err)
	}
	return &SelfIssuer{ID: Identity{RoleServer, "s1"}, CACert: caCert, CAKey: caKey, Bundle: w.bundle,
		Dir: filepath.Join(w.dir, "self"), Validity: validity, CheckEvery: 20 * time.Millisecond, Logger: testLogger(t)}, caCert, caKey
}

// runIssuer runs si.Run until the test ends.
func runIssuer(t *testing.T, si *SelfIssuer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { si.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// A short-lived certificate is renewed at two thirds of its lifetime from
// its issue, not at once and again and again: its NotBefore is backdated
// five minutes, and two thirds from there were in the past (Run renewed
// in a loop, about once a millisecond).
func TestSelfIssuerRenewsAtTwoThirdsOfItsLife(t *testing.T) {
	si, _, _ := selfIssuerOf(t, newWorld(t), 3*time.Second)
	f, err := si.Issue()
	if err != nil {
		t.Fatal(err)
	}
	before := certOf(t, f.Cert).SerialNumber
	runIssuer(t, si)
	time.Sleep(time.Second)
	if certOf(t, f.Cert).SerialNumber.Cmp(before) != 0 {
		t.Fatal("a certificate of 3 s was renewed within 1 s of its issue")
	}
	deadline := time.Now().Add(4 * time.Second)
	for certOf(t, f.Cert).SerialNumber.Cmp(before) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("a certificate of 3 s was not renewed within 5 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A CA replaced after the pair was issued and before Run looked at it
// for the first time is seen: Run compares with the CA the pair was
// issued from, not with the CA it first saw.
func TestSelfIssuerSeesACAChangedBeforeRun(t *testing.T) {
	si, caCert, caKey := selfIssuerOf(t, newWorld(t), time.Hour)
	f, err := si.Issue()
	if err != nil {
		t.Fatal(err)
	}
	newCA, err := NewCA("renewed CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caKey, newCA.KeyPEM()); err != nil {
		t.Fatal(err)
	}
	if err := writeFile(caCert, newCA.CertPEM()); err != nil {
		t.Fatal(err)
	}
	runIssuer(t, si)
	deadline := time.Now().Add(3 * time.Second)
	for certOf(t, f.Cert).CheckSignatureFrom(newCA.Cert) != nil {
		if time.Now().After(deadline) {
			t.Fatal("not issued from the CA replaced before Run started within 3 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
