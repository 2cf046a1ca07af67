package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net/url"
	"testing"
	"time"
)

// newCSR makes a CSR for key that claims uris and dnsNames.
func newCSR(t *testing.T, key crypto.Signer, uris []string, dnsNames ...string) []byte {
	t.Helper()
	tmpl := &x509.CertificateRequest{Subject: pkix.Name{CommonName: "claimed", Organization: []string{"server"}}, DNSNames: dnsNames}
	for _, s := range uris {
		u, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, u)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func p256(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// parseAll reads every certificate of a PEM chain.
func parseAll(t *testing.T, chain []byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for rest := chain; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			return out
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
}

// SignCSR certifies the request's key as the identity it is given and
// nothing the request asks for: one URI, no DNS names, client
// authentication only, the validity asked, a chain to the CA.
func TestSignCSRNamesOnlyTheGivenIdentity(t *testing.T) {
	ca, err := NewCA("cluster", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key := p256(t)
	csr := newCSR(t, key, []string{"stor://server/s1", "stor://operator/root"}, "stor-0.stor")
	now := time.Now()
	id := Identity{RoleCSINode, "worker-1"}
	chain, err := ca.Issuer().SignCSR(csr, id, now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certs := parseAll(t, chain)
	if len(certs) != 1 {
		t.Fatalf("a root issuer's chain holds %d certificates, want the leaf only", len(certs))
	}
	leaf := certs[0]
	if got, err := IdentityOf(leaf); err != nil || got != id || len(leaf.URIs) != 1 || len(leaf.DNSNames) != 0 {
		t.Fatalf("identity %v (%v), URIs %v, DNS %v; want only %s", got, err, leaf.URIs, leaf.DNSNames, id)
	}
	if !leaf.PublicKey.(*ecdsa.PublicKey).Equal(&key.PublicKey) {
		t.Error("the certificate is not for the request's key")
	}
	if !leaf.NotAfter.Equal(now.Add(time.Hour).Truncate(time.Second)) || leaf.NotBefore.After(now) || now.Sub(leaf.NotBefore) > CSRClockSkew+time.Second {
		t.Errorf("valid %v..%v, want from shortly before %v for an hour", leaf.NotBefore, leaf.NotAfter, now)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("as a client: %v", err)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Error("the node certificate also serves as a server's")
	}
	other, err := ca.Issuer().SignCSR(csr, id, now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if parseAll(t, other)[0].SerialNumber.Cmp(leaf.SerialNumber) == 0 {
		t.Error("two certificates with one serial")
	}
}

// A request not signed by its key, for a weak key, or not a request at
// all is refused; a certificate never outlives its issuer, and an expired
// issuer issues nothing.
func TestSignCSRRefuses(t *testing.T) {
	ca, err := NewCA("cluster", 30*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	iss := ca.Issuer()
	id := Identity{RoleCSINode, "worker-1"}
	now := time.Now()

	good := newCSR(t, p256(t), nil)
	b, _ := pem.Decode(good)
	b.Bytes[len(b.Bytes)-3] ^= 0xff // inside the signature
	forged := pem.EncodeToMemory(b)
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	for name, csr := range map[string][]byte{
		"forged signature": forged,
		"RSA 1024":         newCSR(t, weak, nil),
		"not PEM":          []byte("hello"),
		"a certificate":    ca.CertPEM(),
	} {
		if _, err := iss.SignCSR(csr, id, now, time.Hour); !errors.Is(err, ErrCSR) {
			t.Errorf("%s: %v, want ErrCSR", name, err)
		}
	}
	chain, err := iss.SignCSR(good, id, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if got := parseAll(t, chain)[0].NotAfter; got.After(ca.Cert.NotAfter) {
		t.Errorf("certificate until %v outlives its issuer (%v)", got, ca.Cert.NotAfter)
	}
	if _, err := iss.SignCSR(good, id, ca.Cert.NotAfter.Add(time.Second), time.Hour); !errors.Is(err, ErrIssuer) {
		t.Errorf("an expired issuer: %v, want ErrIssuer", err)
	}
	if _, err := iss.SignCSR(good, Identity{RoleCSINode, "a/b"}, now, time.Hour); !errors.Is(err, ErrIdentity) {
		t.Errorf("an invalid identity: %v, want ErrIdentity", err)
	}
}

// ParseIssuer takes what cert-manager's CA secrets hold (an RSA key as
// PKCS#1, keys as PKCS#8) and an intermediate with its chain; it refuses a
// key that is not the certificate's and a certificate that is no CA. An
// intermediate's certificates follow each certificate it signs.
func TestParseIssuer(t *testing.T) {
	// A root that allows an intermediate (NewCA's do not).
	rootKey := p256(t)
	now := time.Now()
	rootTmpl := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: "root"},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true, MaxPathLen: 1,
	}
	rootDER, err := x509.CreateCertificate(rand.Reader, rootTmpl, rootTmpl, &rootKey.PublicKey, rootKey)
	if err != nil {
		t.Fatal(err)
	}
	rootCert, err := x509.ParseCertificate(rootDER)
	if err != nil {
		t.Fatal(err)
	}
	root := &CA{Cert: rootCert, Key: rootKey}
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: "intermediate"},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, root.Cert, &rsaKey.PublicKey, root.Key)
	if err != nil {
		t.Fatal(err)
	}
	interPEM := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), root.CertPEM()...)
	pkcs1 := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(rsaKey)})
	p8, err := x509.MarshalPKCS8PrivateKey(rsaKey)
	if err != nil {
		t.Fatal(err)
	}
	pkcs8 := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: p8})
	for name, keyPEM := range map[string][]byte{"PKCS#1": pkcs1, "PKCS#8": pkcs8} {
		iss, err := ParseIssuer(interPEM, keyPEM)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		chain, err := iss.SignCSR(newCSR(t, p256(t), nil), Identity{RoleCSINode, "worker-1"}, now, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		certs := parseAll(t, chain)
		roots, inter := x509.NewCertPool(), x509.NewCertPool()
		roots.AddCert(root.Cert)
		for _, c := range certs[1:] {
			inter.AddCert(c)
		}
		if _, err := certs[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
			t.Errorf("%s: the chain (%d certificates) does not verify to the root: %v", name, len(certs), err)
		}
	}
	if _, err := ParseIssuer(interPEM, root.KeyPEM()); !errors.Is(err, ErrIssuer) {
		t.Errorf("another CA's key: %v, want ErrIssuer", err)
	}
	leafPEM, leafKey, err := root.Issue(Identity{RoleServer, "s1"}, now, now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ParseIssuer(leafPEM, leafKey); !errors.Is(err, ErrIssuer) {
		t.Errorf("a server certificate as issuer: %v, want ErrIssuer", err)
	}
}
