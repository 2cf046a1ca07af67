package k8stest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is the control plane's certificate authority and the files made
// from it in dir.
type pki struct {
	dir    string
	caCert *x509.Certificate
	caKey  *ecdsa.PrivateKey
	caFile string
	serial int64
}

func newPKI(dir string) (*pki, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "stor-k8stest-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, caCert: cert, caKey: key, caFile: filepath.Join(dir, "ca.crt"), serial: 1}
	if err := writePEM(p.caFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, nil
}

// issue writes name.crt and name.key: a serving certificate when hosts is
// not empty, a client certificate for user cn in groups otherwise.
func (p *pki) issue(name, cn string, groups []string, hosts ...string) (certFile, keyFile string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	p.serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(p.serial),
		Subject:      pkix.Name{CommonName: cn, Organization: groups},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if len(hosts) > 0 {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		for _, h := range hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, p.caKey)
	if err != nil {
		return "", "", err
	}
	certFile, keyFile = filepath.Join(p.dir, name+".crt"), filepath.Join(p.dir, name+".key")
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	if err := writeKey(keyFile, key); err != nil {
		return "", "", err
	}
	return certFile, keyFile, nil
}

// serviceAccountKey writes the key pair that signs service account tokens.
func (p *pki) serviceAccountKey() (pub, priv string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	der, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	pub, priv = filepath.Join(p.dir, "sa.pub"), filepath.Join(p.dir, "sa.key")
	if err := writePEM(pub, "PUBLIC KEY", der); err != nil {
		return "", "", err
	}
	return pub, priv, writeKey(priv, key)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}

func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("k8stest: %w", err)
	}
	return nil
}

// kubeconfig writes a kubeconfig for the apiserver at server with either
// a client certificate or a bearer token.
func (p *pki) kubeconfig(name, server, certFile, keyFile, token string) (string, error) {
	user := fmt.Sprintf("    client-certificate: %s\n    client-key: %s\n", certFile, keyFile)
	if token != "" {
		user = fmt.Sprintf("    token: %s\n", token)
	}
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: k8stest
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
%scontexts:
- name: k8stest
  context:
    cluster: k8stest
    user: %s
current-context: k8stest
`, server, p.caFile, name, user, name)
	path := filepath.Join(p.dir, name+".kubeconfig")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		return "", fmt.Errorf("k8stest: %w", err)
	}
	return path, nil
}
