package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// The controller refuses each node flag with an error naming it, before
// it dials or listens on anything (the endpoint is one Run would refuse,
// so a binary that accepted the flag fails fast with another error).
func TestControllerRefusesNodeFlags(t *testing.T) {
	for _, flag := range []string{"--node-id=worker-1", "--zone=a", "--state-dir=/var/lib/stor-csi", "--max-volumes=8"} {
		name, _, _ := strings.Cut(flag, "=")
		err := run(context.Background(), []string{"--mode=controller", "--insecure", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", flag}, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "("+name+") is for node mode") {
			t.Errorf("stor-csi --mode=controller %s: %v, want an error naming %s", flag, err, name)
		}
	}
}

// Without certificates stor-csi starts only with --insecure, and says how
// to give it certificates.
func TestNoCertificatesRefused(t *testing.T) {
	err := run(context.Background(), []string{"--mode=controller", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1"}, io.Discard)
	if !errors.Is(err, errNoCertificates) || !strings.Contains(err.Error(), "--tls-cert") {
		t.Fatalf("no certificates, no --insecure: %v, want errNoCertificates naming --tls-cert", err)
	}
	if err := run(context.Background(), []string{"--mode=controller", "--insecure", "--servers=10.0.0.1:7400", "--endpoint=tcp://127.0.0.1:1"}, io.Discard); err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Fatalf("--insecure with a remote server: %v, want an error naming loopback", err)
	}
}

// Under TLS the certificate must be the mode's: a controller's for the
// controller, the node's own for the node plugin.
func TestCheckRole(t *testing.T) {
	ctl := pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"}
	w1 := pki.Identity{Role: pki.RoleCSINode, Name: "worker-1"}
	for _, tc := range []struct {
		id     pki.Identity
		mode   csi.Mode
		nodeID string
		ok     bool
	}{
		{ctl, csi.ModeController, "", true},
		{w1, csi.ModeController, "", false},
		{w1, csi.ModeNode, "worker-1", true},
		{w1, csi.ModeNode, "worker-2", false},
		{ctl, csi.ModeNode, "worker-1", false},
		{pki.Identity{Role: pki.RoleOperator, Name: "x"}, csi.ModeController, "", false},
		{w1, csi.ModeAll, "worker-1", false},
		{ctl, csi.ModeAll, "worker-1", false},
	} {
		if err := checkRole(tc.id, tc.mode, tc.nodeID); (err == nil) != tc.ok {
			t.Errorf("%s as %s on %q: %v, want ok=%v", tc.id, tc.mode, tc.nodeID, err, tc.ok)
		}
	}
	err := run(context.Background(), []string{"--mode=controller", "--servers=10.0.0.1:7400", "--endpoint=tcp://127.0.0.1:1", "--insecure"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("--insecure with a remote server: %v", err)
	}
}

// The bootstrap flags are the node's, replace --tls-cert, and come
// together; each wrong combination is refused with an error naming it,
// before anything is dialled.
func TestBootstrapFlagsRefused(t *testing.T) {
	boot := []string{"--tls-bootstrap-cert=/b/tls.crt", "--tls-bootstrap-key=/b/tls.key", "--token-file=/t/token", "--tls-dir=/run/tls", "--tls-ca=/b/ca.crt"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{append([]string{"--mode=controller"}, boot...), "are for --mode=node"},
		{append([]string{"--mode=node", "--node-id=w1", "--tls-cert=/c", "--tls-key=/k"}, boot...), "replaces --tls-cert"},
		{append([]string{"--mode=node", "--node-id=w1", "--insecure"}, boot...), "--insecure with --tls-bootstrap-cert"},
		{append([]string{"--mode=node", "--node-id=w1"}, boot[:3]...), "needs --tls-bootstrap-cert, --tls-bootstrap-key, --token-file, --tls-dir and --tls-ca"},
	} {
		err := run(context.Background(), append([]string{"--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1"}, tc.args...), io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("stor-csi %s: %v, want an error containing %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// reviewer is the Kubernetes TokenReview API of a node plugin pod on
// worker-1.
type reviewer struct{}

func (reviewer) Review(_ context.Context, token string) (server.TokenReview, error) {
	if token != "pod-token" {
		return server.TokenReview{Error: "invalid bearer token"}, nil
	}
	return server.TokenReview{
		Authenticated: true, Username: server.DefaultNodeServiceAccount, Audiences: []string{server.TokenAudience},
		Extra: map[string][]string{server.NodeNameExtra: {"worker-1"}},
	}, nil
}

// The node plugin's start with a bootstrap certificate leaves in --tls-dir
// a certificate for --node-id that the mode's check accepts; a csi-node
// certificate given as the bootstrap one is refused.
func TestBootstrapStart(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true, Configure: func(_ int, cfg *server.Config) {
		dir := servertest.TLSDirOf(*cfg)
		cfg.NodeCerts = server.NodeCertConfig{IssuerCert: filepath.Join(dir, "ca.crt"), IssuerKey: filepath.Join(dir, "ca.key"), Reviewer: reviewer{}}
	}})
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("pod-token"), 0o600); err != nil {
		t.Fatal(err)
	}
	bootFiles := c.TLSFiles(pki.Identity{Role: pki.RoleCSINodeBootstrap, Name: "stor-csi-node"})
	cfg := csi.DefaultConfig()
	cfg.Mode, cfg.NodeID = csi.ModeNode, "worker-1"
	cfg.Logger = slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	flags := bootstrapFlags{cert: bootFiles.Cert, key: bootFiles.Key, tokenFile: token, dir: filepath.Join(t.TempDir(), "tls")}
	b, closeBoot, err := flags.start(ctx, cfg, []string{c.Nodes[0].Addr}, pki.Files{CA: bootFiles.CA}, false)
	if err != nil {
		t.Fatal(err)
	}
	defer closeBoot()
	src, err := pki.Load(b.Files(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkRole(src.Identity(), cfg.Mode, cfg.NodeID); err != nil {
		t.Errorf("the obtained certificate: %v", err)
	}

	nodeFiles := c.TLSFiles(pki.Identity{Role: pki.RoleCSINode, Name: "worker-1"})
	flags.cert, flags.key = nodeFiles.Cert, nodeFiles.Key
	if _, _, err := flags.start(ctx, cfg, []string{c.Nodes[0].Addr}, pki.Files{CA: bootFiles.CA}, false); err == nil || !strings.Contains(err.Error(), "csi-node-bootstrap") {
		t.Errorf("a csi-node certificate as the bootstrap one: %v, want refused", err)
	}
}

// --log-format=json makes every log line a JSON object (here the warning
// about running --insecure, before the endpoint is refused); another
// value is refused before anything is logged.
func TestLogFormat(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"--mode=controller", "--insecure", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", "--log-format=json"}, &out)
	if err == nil {
		t.Fatal("a tcp:// endpoint was accepted")
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if out.Len() == 0 {
		t.Fatal("nothing logged")
	}
	warned := false
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("--log-format=json logged a line that is not JSON: %q", l)
		}
		msg, _ := m["msg"].(string)
		warned = warned || (m["level"] == "WARN" && strings.Contains(msg, "no TLS"))
	}
	if !warned {
		t.Fatalf("no JSON warning about TLS in %q", out.String())
	}
	out.Reset()
	err = run(context.Background(), []string{"--mode=controller", "--servers=127.0.0.1:1", "--log-format=logfmt"}, &out)
	if !errors.Is(err, logging.ErrFormat) || !strings.Contains(err.Error(), `"logfmt"`) || out.Len() != 0 {
		t.Fatalf("--log-format=logfmt: %v (logged %q), want an error naming it and nothing logged", err, out.String())
	}
}
