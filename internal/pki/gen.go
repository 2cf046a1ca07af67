package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority that issues role certificates: ECDSA
// P-256, for make cluster and tests. Production certificates come from
// cert-manager (deploy/).
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
}

// NewCA makes a self-signed CA valid from now-1h for validity.
func NewCA(name string, validity time.Duration) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

// LoadCA reads a CA written by WriteFiles.
func LoadCA(certFile, keyFile string) (*CA, error) {
	cb, err := os.ReadFile(certFile)
	if err != nil {
		return nil, err
	}
	kb, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	cblock, _ := pem.Decode(cb)
	kblock, _ := pem.Decode(kb)
	if cblock == nil || kblock == nil {
		return nil, fmt.Errorf("pki: %s or %s is not PEM", certFile, keyFile)
	}
	cert, err := x509.ParseCertificate(cblock.Bytes)
	if err != nil {
		return nil, err
	}
	key, err := x509.ParseECPrivateKey(kblock.Bytes)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

// CertPEM is the CA certificate, PEM.
func (ca *CA) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// KeyPEM is the CA key, PEM.
func (ca *CA) KeyPEM() []byte {
	return keyPEM(ca.Key)
}

// Issue makes a certificate for id valid in [notBefore, notAfter), usable
// both as a server and as a client, and returns it and its key as PEM.
func (ca *CA) Issue(id Identity, notBefore, notAfter time.Time) (certPEM, keyPEMBytes []byte, err error) {
	if err := id.Validate(); err != nil {
		return nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: id.Name, Organization: []string{string(id.Role)}},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URI()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM(key), nil
}

func keyPEM(key *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		panic(err) // a P-256 key always marshals
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err)
	}
	return n
}

// LocalValidity is how long EnsureLocal's certificates last.
const LocalValidity = 10 * 365 * 24 * time.Hour

// LocalFiles are the files EnsureLocal writes for id in dir:
// <role>-<name>.crt, .key, and the bundle ca.crt.
func LocalFiles(dir string, id Identity) Files {
	base := filepath.Join(dir, string(id.Role)+"-"+id.Name)
	return Files{Cert: base + ".crt", Key: base + ".key", CA: filepath.Join(dir, "ca.crt")}
}

// EnsureLocal makes dir (0700) hold a CA (ca.crt, ca.key) and a
// certificate for each of ids, creating only what is missing: run again, it
// keeps what exists, so a cluster's certificates survive its restarts.
func EnsureLocal(dir string, ids ...Identity) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return err
	}
	caCert, caKey := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	ca, err := LoadCA(caCert, caKey)
	if errors.Is(err, fs.ErrNotExist) {
		if ca, err = NewCA("stor local CA", LocalValidity); err != nil {
			return err
		}
		if err := writeFile(caKey, ca.KeyPEM()); err != nil {
			return err
		}
		if err := writeFile(caCert, ca.CertPEM()); err != nil {
			return err
		}
	} else if err != nil {
		return fmt.Errorf("pki: local CA in %s: %w", dir, err)
	}
	now := time.Now()
	for _, id := range ids {
		f := LocalFiles(dir, id)
		if _, err := os.Stat(f.Cert); err == nil {
			continue
		}
		c, k, err := ca.Issue(id, now.Add(-time.Hour), now.Add(LocalValidity))
		if err != nil {
			return err
		}
		if err := writeFile(f.Key, k); err != nil {
			return err
		}
		if err := writeFile(f.Cert, c); err != nil {
			return err
		}
	}
	return nil
}

// writeFile writes data to name atomically (a temporary file renamed), 0600.
func writeFile(name string, data []byte) error {
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, name)
}
