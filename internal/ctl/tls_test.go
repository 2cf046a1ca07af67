package ctl

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/servertest"
)

// clearTLSEnv makes the test independent of the caller's environment
// and of a ./stor-data in the working directory.
func clearTLSEnv(t *testing.T) {
	for _, e := range []string{certEnv, keyEnv, caEnv} {
		t.Setenv(e, "")
	}
	t.Setenv(dataEnv, t.TempDir())
}

func TestTLSOperatorCertificate(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a server; skipped with -short")
	}
	clearTLSEnv(t)
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true})
	addr := c.Nodes[0].Addr
	f := c.TLSFiles(LocalOperator)
	status := []string{"--server", addr, "--timeout", "3s", "cluster", "status"}

	if r := run(t, append([]string{"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}, status...)...); r.code != 0 {
		t.Fatalf("with --tls-*: exit %d, %s", r.code, r.stderr)
	}
	if r := runAsIs(t, status...); r.code != 2 || !strings.Contains(r.stderr, "no certificate") || !strings.Contains(r.stderr, "--insecure") {
		t.Fatalf("without a certificate: exit %d, %q; want 2 saying there is no certificate and how to give one", r.code, r.stderr)
	}
	if r := run(t, append([]string{"--insecure"}, status...)...); r.code != 1 {
		t.Fatalf("--insecure against a TLS server: exit %d, %s; want 1", r.code, r.stderr)
	}
	if r := run(t, append([]string{"--insecure", "--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}, status...)...); r.code != 2 {
		t.Fatalf("--insecure with a certificate: exit %d, %s; want 2", r.code, r.stderr)
	}

	t.Run("environment", func(t *testing.T) {
		t.Setenv(certEnv, f.Cert)
		t.Setenv(keyEnv, f.Key)
		t.Setenv(caEnv, f.CA)
		if r := runAsIs(t, status...); r.code != 0 {
			t.Fatalf("exit %d, %s", r.code, r.stderr)
		}
	})
	t.Run("make cluster's data dir", func(t *testing.T) {
		t.Setenv(dataEnv, filepath.Dir(c.TLSDir()))
		if r := runAsIs(t, status...); r.code != 0 {
			t.Fatalf("exit %d, %s", r.code, r.stderr)
		}
	})
}

func TestInsecureRefusesRemoteServers(t *testing.T) {
	clearTLSEnv(t)
	for _, srv := range []string{"10.0.0.1:7400", "stor-0.stor:7400", "127.0.0.1:7400,192.168.1.2:7400"} {
		r := run(t, "--insecure", "--server", srv, "--timeout", "1s", "cluster", "status")
		if r.code != 2 || !strings.Contains(r.stderr, "loopback") {
			t.Errorf("--insecure --server %s: exit %d, %q; want 2 naming loopback", srv, r.code, r.stderr)
		}
	}
}

func TestCertsLocal(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	out := mustRun(t, "certs", "local", "--dir", dir, "--server", "s1,s2", "--node", "worker-1")
	if !strings.Contains(out, dir) {
		t.Fatalf("output %q", out)
	}
	for _, id := range []pki.Identity{
		{Role: pki.RoleServer, Name: "s1"}, {Role: pki.RoleServer, Name: "s2"},
		{Role: pki.RoleCSINode, Name: "worker-1"}, {Role: pki.RoleCSIController, Name: "stor-csi"}, LocalOperator,
	} {
		src, err := pki.Load(pki.LocalFiles(dir, id), nil)
		if err != nil {
			t.Fatal(err)
		}
		if src.Identity() != id {
			t.Fatalf("%v: certificate of %v", id, src.Identity())
		}
	}
	before, _ := os.ReadFile(pki.LocalFiles(dir, LocalOperator).Cert)
	mustRun(t, "certs", "local", "--dir", dir, "--server", "s3")
	after, _ := os.ReadFile(pki.LocalFiles(dir, LocalOperator).Cert)
	if string(before) != string(after) {
		t.Fatal("a second run replaced the operator's certificate")
	}
	if r := run(t, "certs", "local", "--dir", dir, "--server", "bad/id"); r.code != 2 {
		t.Fatalf("a bad id: exit %d, %s", r.code, r.stderr)
	}
}

// nbd serve with the operator's certificate opens the volume through the
// control API and the servers' data ports, both under TLS.
func TestNBDServeOverTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	clearTLSEnv(t)
	c := servertest.NewCluster(t, servertest.Options{TLS: true})
	createVolume(t, c, "nbd-tls", 16*mib)
	f := c.TLSFiles(LocalOperator)
	sock := filepath.Join(t.TempDir(), "tls.sock")
	s := startNBDServe(t, c, "nbd-tls", "--listen", "unix:"+sock, "--node", "test-node",
		"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA)
	if code := s.stop(); code != 0 {
		t.Fatalf("nbd serve exited %d\nstderr:\n%s", code, s.stderr)
	}
}
