package e2etest

import (
	"path/filepath"
	"slices"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
)

// Servers given the CA's certificate and key instead of a certificate of
// their own (deploy/: cert-manager's stor-ca secret) issue their own
// stor://server/<id>, and form a cluster with a server whose certificate
// was issued beforehand.
func TestServersIssueTheirOwnCertificates(t *testing.T) {
	requireBinaries(t)
	c := newCluster(t, 3)
	for _, s := range c.servers[1:] {
		i := slices.Index(s.args, "--tls-cert")
		s.args = slices.Delete(s.args, i, i+4) // --tls-cert F --tls-key F
		s.args = append(s.args, "--tls-issuer-cert", filepath.Join(tlsDir, "ca.crt"), "--tls-issuer-key", filepath.Join(tlsDir, "ca.key"),
			"--tls-dir", filepath.Join(t.TempDir(), s.id))
	}
	c.startAll(t)
	st := &storpb.StatusResponse{}
	c.eventually(t, formTimeout, "3 members up with a leader", func() error {
		if err := ctlJSON(t, st, "--server", c.addrs(), "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
			return err
		}
		return membersUp(st, "s1", "s2", "s3")
	})
	for _, s := range c.servers[1:] {
		dir := s.args[slices.Index(s.args, "--tls-dir")+1]
		src, err := pki.Load(pki.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(tlsDir, "ca.crt")}, nil)
		if err != nil {
			t.Fatalf("%s: its self-issued certificate: %v", s.id, err)
		}
		if want := (pki.Identity{Role: pki.RoleServer, Name: s.id}); src.Identity() != want {
			t.Fatalf("%s issued itself %v, want %v", s.id, src.Identity(), want)
		}
	}
}
