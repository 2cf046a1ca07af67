package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"net/url"
	"os"
	"time"
)

// Issuer is a CA that signs certificate requests (SignCSR): the CA's
// certificate and key, of any type a CA's files hold (cert-manager writes
// RSA or ECDSA keys as PKCS#1, PKCS#8 or SEC 1).
type Issuer struct {
	Cert *x509.Certificate
	// Chain holds the certificates after Cert in its file (the CA's own
	// issuers, if it is an intermediate); they follow every certificate
	// SignCSR returns.
	Chain []*x509.Certificate
	Key   crypto.Signer
}

// LoadIssuer reads an issuing CA: certFile holds its certificate first
// (then, optionally, its own issuers), keyFile its private key, PEM.
func LoadIssuer(certFile, keyFile string) (*Issuer, error) {
	cb, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrIssuer, err)
	}
	kb, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrIssuer, err)
	}
	iss, err := ParseIssuer(cb, kb)
	if err != nil {
		return nil, fmt.Errorf("%s, %s: %w", certFile, keyFile, err)
	}
	return iss, nil
}

// ParseIssuer is LoadIssuer of the files' contents. It refuses a
// certificate that is not a CA allowed to sign certificates, and a key
// that is not the certificate's.
func ParseIssuer(certPEM, keyPEM []byte) (*Issuer, error) {
	var certs []*x509.Certificate
	for rest := certPEM; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrIssuer, err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("%w: no PEM certificate", ErrIssuer)
	}
	cert := certs[0]
	if !cert.BasicConstraintsValid || !cert.IsCA || (cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0) {
		return nil, fmt.Errorf("%w: %q is not a CA that may sign certificates", ErrIssuer, cert.Subject.CommonName)
	}
	key, err := parseKey(keyPEM)
	if err != nil {
		return nil, err
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("%w: the key is not the key of %q", ErrIssuer, cert.Subject.CommonName)
	}
	return &Issuer{Cert: cert, Chain: certs[1:], Key: key}, nil
}

// parseKey reads the first private key in PEM data: PKCS#8, PKCS#1 (RSA)
// or SEC 1 (EC).
func parseKey(data []byte) (crypto.Signer, error) {
	for rest := data; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			return nil, fmt.Errorf("%w: no PEM private key", ErrIssuer)
		}
		var k any
		var err error
		switch b.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(b.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrIssuer, b.Type, err)
		}
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("%w: a %T cannot sign", ErrIssuer, k)
		}
		return s, nil
	}
}

// Issuer is ca as an Issuer.
func (ca *CA) Issuer() *Issuer { return &Issuer{Cert: ca.Cert, Key: ca.Key} }

// CSRClockSkew bounds how far before now SignCSR's certificates start (a
// tenth of their validity, at most this), so that a peer whose clock is
// slightly behind accepts them at once.
const CSRClockSkew = 5 * time.Minute

// SignCSR signs the public key of the PKCS#10 request csrPEM (PEM
// "CERTIFICATE REQUEST") as id, for client authentication only, valid from
// shortly before now (see CSRClockSkew) until now+validity (cut at the
// issuer's own expiry), with a random serial. Only the request's key is used, after checking the
// request is signed with it (the caller holds the private key): its
// subject, SANs and extensions are ignored, so the identity is what the
// caller of SignCSR decided, never what the requester asked for. It
// returns the certificate, PEM, followed by the issuer's certificate when
// that is not a self-signed root, and its Chain.
func (iss *Issuer) SignCSR(csrPEM []byte, id Identity, now time.Time, validity time.Duration) ([]byte, error) {
	if err := id.Validate(); err != nil {
		return nil, err
	}
	if validity <= 0 {
		return nil, fmt.Errorf("pki: validity %v: want a positive duration", validity)
	}
	b, _ := pem.Decode(csrPEM)
	if b == nil || b.Type != "CERTIFICATE REQUEST" {
		return nil, fmt.Errorf("%w: not a PEM CERTIFICATE REQUEST", ErrCSR)
	}
	csr, err := x509.ParseCertificateRequest(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCSR, err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("%w: not signed by its key: %v", ErrCSR, err)
	}
	if err := acceptableKey(csr.PublicKey); err != nil {
		return nil, err
	}
	notAfter := now.Add(validity)
	if !now.Before(iss.Cert.NotAfter) {
		return nil, fmt.Errorf("%w: %q expired at %v", ErrIssuer, iss.Cert.Subject.CommonName, iss.Cert.NotAfter)
	}
	if notAfter.After(iss.Cert.NotAfter) {
		notAfter = iss.Cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: id.Name, Organization: []string{string(id.Role)}},
		NotBefore:    now.Add(-min(CSRClockSkew, validity/10)),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URI()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, iss.Cert, csr.PublicKey, iss.Key)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrIssuer, err)
	}
	out := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if !bytes.Equal(iss.Cert.RawIssuer, iss.Cert.RawSubject) {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: iss.Cert.Raw})...)
	}
	for _, c := range iss.Chain {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out, nil
}

// acceptableKey admits ECDSA P-256/P-384/P-521, Ed25519 and RSA of at
// least 2048 bits.
func acceptableKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256(), elliptic.P384(), elliptic.P521():
			return nil
		}
		return fmt.Errorf("%w: ECDSA curve %s", ErrCSR, k.Curve.Params().Name)
	case ed25519.PublicKey:
		return nil
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return fmt.Errorf("%w: RSA key of %d bits, want at least 2048", ErrCSR, k.N.BitLen())
		}
		return nil
	}
	return fmt.Errorf("%w: key type %T", ErrCSR, pub)
}
