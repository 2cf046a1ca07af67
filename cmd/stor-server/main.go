// Command stor-server runs one stor storage server: a member of the
// metadata Raft group and the control API. With no flags it starts a
// one-server cluster in ./stor-data on loopback.
//
//	stor-server --id s1 --data-dir /var/lib/stor --join 10.0.0.1:7400,10.0.0.2:7400
//
// In a StatefulSet give every pod the same --join list of its peers' stable
// DNS names: the pod whose id (host name) ends in -0 bootstraps the cluster
// the first time, every other pod joins it, and a restarted pod resumes
// with its state.
//
// With --node-issuer-cert and --node-issuer-key the server also issues CSI
// node plugins their certificates (stor://csi-node/<node>), having the
// Kubernetes TokenReview API vouch for the node their pod runs on; see
// package server (nodecert.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/stor-io/stor/internal/bytesize"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "stor-server: %v\n", err)
		os.Exit(1)
	}
}

// run runs the binary with args until ctx ends; logs go to stderr.
func run(ctx context.Context, args []string, stderr io.Writer) error {
	cfg := server.DefaultConfig()
	fs := flag.NewFlagSet("stor-server", flag.ContinueOnError)
	fs.StringVar(&cfg.ID, "id", cfg.ID, "server id, stable across restarts (default: the host name)")
	fs.StringVar(&cfg.DataDir, "data-dir", cfg.DataDir, "directory for Raft state and metadata")
	fs.StringVar(&cfg.Listen, "listen", cfg.Listen, "control gRPC listen address")
	fs.StringVar(&cfg.RaftListen, "raft-listen", cfg.RaftListen, "Raft transport listen address")
	fs.StringVar(&cfg.DataListen, "data-listen", cfg.DataListen, "replica data service listen address")
	fs.StringVar(&cfg.Advertise, "advertise", "", "control address others dial (default: the bound --listen address)")
	fs.StringVar(&cfg.RaftAdvertise, "raft-advertise", "", "Raft address others dial (default: the bound --raft-listen address)")
	fs.StringVar(&cfg.DataAdvertise, "data-advertise", "", "data address others dial (default: --data-listen)")
	fs.StringVar(&cfg.LocalSocket, "local-socket", "", "unix socket on which volume engines on this host get short-circuit reads of this server's replicas (mode 0600; default: none)")
	join := fs.String("join", "", "comma-separated control addresses of existing members; empty bootstraps a new cluster")
	fs.StringVar(&cfg.Zone, "zone", "", "zone of this server, for replica placement")
	fs.StringVar(&cfg.KubernetesNode, "k8s-node", "", "the Kubernetes node this server runs on (the pod's spec.nodeName): a volume provisioned for a pod on that node gets a replica here")
	labels := fs.String("labels", "", "comma-separated key=value labels, for placement")
	capacity := fs.String("capacity", "", "bytes replicas may use here, e.g. 500GiB (default: the data dir's filesystem size)")
	voters := fs.Int("max-voters", cfg.Raft.MaxVoters, "the first N servers to join are Raft voters, the rest non-voters")
	downAfter := fs.Duration("server-down-timeout", cfg.Raft.ServerDownTimeout, "the leader marks a server down after this long without a heartbeat")
	replaceAfter := fs.Duration("replace-after", cfg.Raft.ReplaceAfter, "while this server leads, a replica faulty this long is replaced elsewhere; stor-ctl cluster config set --replace-after overrides it cluster-wide")
	fs.StringVar(&cfg.MetricsListen, "metrics-listen", "", "host:port for plain HTTP /metrics (Prometheus), /healthz and /readyz (a Raft member that knows its leader); empty: none")
	fs.IntVar(&cfg.API.MaxConns, "api-max-conns", cfg.API.MaxConns, "control API connections served at once (more wait to be accepted)")
	fs.IntVar(&cfg.Data.MaxConns, "data-max-conns", cfg.Data.MaxConns, "replica data connections served at once (more are refused)")
	fs.Int64Var(&cfg.Data.MaxMemory, "data-max-memory", cfg.Data.MaxMemory, "bytes of payload buffers all replica data connections together may hold")
	var files pki.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "PEM certificate of this server (URI SAN stor://server/<id>); re-read when it changes")
	fs.StringVar(&files.Key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&files.CA, "tls-ca", "", "PEM CA bundle every peer's certificate must chain to")
	issuerCert := fs.String("tls-issuer-cert", "", "PEM certificate of a CA whose key is --tls-issuer-key: without --tls-cert, this server issues its own certificate from it (stor://server/<id>, renewed; deploy/ mounts cert-manager's stor-ca)")
	issuerKey := fs.String("tls-issuer-key", "", "PEM key of --tls-issuer-cert")
	tlsDir := fs.String("tls-dir", "", "where a certificate issued from --tls-issuer-cert is written (a directory of its own, not under --data-dir)")
	fs.BoolVar(&cfg.Insecure, "insecure", false, "run without TLS; every address must then be on loopback")
	fs.StringVar(&cfg.NodeCerts.IssuerCert, "node-issuer-cert", "", "PEM certificate of the CA that signs CSI node plugins' certificates (IssueNodeCertificate; --tls-ca must trust it, e.g. the cluster CA); empty: issue none")
	fs.StringVar(&cfg.NodeCerts.IssuerKey, "node-issuer-key", "", "PEM key of --node-issuer-cert")
	fs.StringVar(&cfg.NodeCerts.ServiceAccount, "node-service-account", server.DefaultNodeServiceAccount, "the Kubernetes user whose pod-bound token (audience \""+server.TokenAudience+"\") may obtain a node certificate")
	fs.DurationVar(&cfg.NodeCerts.Validity, "node-cert-validity", 24*time.Hour, "how long an issued node certificate lasts (node plugins renew at 2/3 of it)")
	fs.StringVar(&cfg.NodeCerts.Kubeconfig, "kubeconfig", "", "kubeconfig of the Kubernetes API that reviews node plugin tokens (default: in-cluster; needs create on tokenreviews)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", logging.FormatText, logging.FormatUsage)
	fs.BoolVar(&cfg.InsecureDataInspect, "insecure-data-inspect", false, "let any peer of the data port read any replica at its committed epoch (test harnesses only; never in a deployment)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg.Join = splitList(*join)
	var err error
	if cfg.Labels, err = parseLabels(*labels); err != nil {
		return err
	}
	if *capacity != "" {
		if cfg.Capacity, err = bytesize.Parse(*capacity); err != nil {
			return fmt.Errorf("--capacity: %w", err)
		}
	}
	cfg.Raft.MaxVoters, cfg.Raft.ServerDownTimeout = *voters, *downAfter
	if *replaceAfter <= 0 {
		return fmt.Errorf("--replace-after %v: want a positive duration", *replaceAfter)
	}
	cfg.Raft.ReplaceAfter = *replaceAfter
	if cfg.Logger, err = logging.New(stderr, *logFormat, *logLevel); err != nil {
		return err
	}
	if (*issuerCert == "") != (*issuerKey == "") {
		return fmt.Errorf("--tls-issuer-cert and --tls-issuer-key go together")
	}
	if *issuerCert != "" && files.Cert == "" {
		if files.Key != "" || files.CA == "" {
			return fmt.Errorf("a self-issued certificate needs --tls-ca (the bundle) and no --tls-key")
		}
		if *tlsDir == "" {
			return fmt.Errorf("a self-issued certificate needs --tls-dir (not under --data-dir: a directory of its own, e.g. a memory-backed emptyDir)")
		}
		si := &pki.SelfIssuer{ID: pki.Identity{Role: pki.RoleServer, Name: cfg.ID}, CACert: *issuerCert, CAKey: *issuerKey,
			Bundle: files.CA, Dir: *tlsDir, Logger: cfg.Logger}
		if files, err = si.Issue(); err != nil {
			return err
		}
		go si.Run(ctx)
	}
	if files.Set() {
		if cfg.TLS, err = pki.Load(files, cfg.Logger); err != nil {
			return err
		}
	}
	return server.Run(ctx, cfg)
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func parseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range splitList(s) {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--labels: %q is not key=value", kv)
		}
		out[k] = v
	}
	return out, nil
}
