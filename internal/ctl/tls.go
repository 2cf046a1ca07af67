package ctl

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/stor-io/stor/internal/pki"
)

// Environment variables naming the operator's certificate, its key and the
// CA bundle when the --tls-* flags are not given, and the data directory
// of make cluster (whose tls/ holds a certificate stor-ctl finds).
const (
	certEnv = "STOR_CERT"
	keyEnv  = "STOR_KEY"
	caEnv   = "STOR_CA"
	dataEnv = "STOR_DATA"
)

// LocalOperator is the identity make cluster issues stor-ctl.
var LocalOperator = pki.Identity{Role: pki.RoleOperator, Name: "stor-ctl"}

// tlsFiles returns the certificate stor-ctl presents: the --tls-* flags,
// else $STOR_CERT, $STOR_KEY and $STOR_CA, else make cluster's operator
// certificate in $STOR_DATA/tls (default ./stor-data/tls) if it exists;
// the zero Files when there is none.
func (a *app) tlsFiles(cmd *cobra.Command) pki.Files {
	f := a.tls
	for _, e := range []struct {
		field *string
		flag  string
		env   string
	}{{&f.Cert, "tls-cert", certEnv}, {&f.Key, "tls-key", keyEnv}, {&f.CA, "tls-ca", caEnv}} {
		if !cmd.Flags().Changed(e.flag) {
			*e.field = os.Getenv(e.env)
		}
	}
	if f.Set() || a.insecure {
		return f
	}
	dir := os.Getenv(dataEnv)
	if dir == "" {
		dir = "./stor-data"
	}
	local := pki.LocalFiles(filepath.Join(dir, "tls"), LocalOperator)
	if _, err := os.Stat(local.Cert); err == nil {
		return local
	}
	return pki.Files{}
}

// transport returns the gRPC option and the data-port dialer for addrs:
// TLS with the operator's certificate, or plaintext (with --insecure only
// to loopback addresses).
func (a *app) transport(cmd *cobra.Command, addrs []string) ([]grpc.DialOption, func(ctx context.Context, network, addr string) (net.Conn, error), error) {
	files := a.tlsFiles(cmd)
	switch {
	case files.Set() && a.insecure:
		return nil, nil, usageErrorf("--insecure with a TLS certificate (%s)", files.Cert)
	case files.Set():
		src, err := pki.Load(files, nil)
		if err != nil {
			return nil, nil, err
		}
		return []grpc.DialOption{src.GRPCDialCredentials()}, src.Dialer(nil, pki.RoleServer), nil
	case a.insecure:
		if err := pki.CheckLoopback(addrs...); err != nil {
			return nil, nil, usageError{err}
		}
		return nil, nil, nil
	}
	return nil, nil, usageErrorf("no certificate: pass --tls-cert, --tls-key and --tls-ca (or set $%s, $%s and $%s), run from make cluster's directory (or set $%s to its data dir), or pass --insecure for a plaintext cluster on loopback",
		certEnv, keyEnv, caEnv, dataEnv)
}

// newCertsCommand is "stor-ctl certs local": the local CA and certificates
// of make cluster.
func newCertsCommand(a *app) *cobra.Command {
	var dir string
	var servers, nodes []string
	local := &cobra.Command{
		Use:   "local",
		Short: "Create a local CA and certificates in --dir (only what is missing)",
		Long: `Creates, in --dir (mode 0700), a CA (ca.crt, ca.key) and a certificate and
key per --server id (server-<id>.crt), per --node (csi-node-<name>.crt), and
one for stor-ctl (operator-stor-ctl.crt). Files that exist are kept, so
running it again is harmless. For loopback clusters and tests: in
Kubernetes, cert-manager issues the certificates.`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				return usageErrorf("--dir is required")
			}
			ids := []pki.Identity{LocalOperator, {Role: pki.RoleCSIController, Name: "stor-csi"}}
			for _, s := range servers {
				ids = append(ids, pki.Identity{Role: pki.RoleServer, Name: s})
			}
			for _, n := range nodes {
				ids = append(ids, pki.Identity{Role: pki.RoleCSINode, Name: n})
			}
			for _, id := range ids {
				if err := id.Validate(); err != nil {
					return usageError{err}
				}
			}
			if err := pki.EnsureLocal(dir, ids...); err != nil {
				return fmt.Errorf("certs local: %w", err)
			}
			fmt.Fprintf(a.stdout, "certificates in %s\n", dir)
			return nil
		},
	}
	local.Flags().StringVar(&dir, "dir", "", "directory for the CA and certificates")
	local.Flags().StringSliceVar(&servers, "server", nil, "server ids to issue certificates for")
	local.Flags().StringSliceVar(&nodes, "node", nil, "CSI node names to issue certificates for")
	return group("certs", "Manage local certificates", local)
}
