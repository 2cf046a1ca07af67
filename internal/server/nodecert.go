package server

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
)

// Node certificates (ClusterService.IssueNodeCertificate): how a CSI node
// plugin pod, one of a DaemonSet's, gets a certificate naming its own
// Kubernetes node, which no certificate template can (cert-manager cannot
// put a pod's node name into a Certificate). It is kubelet TLS bootstrap
// with Kubernetes as the witness of where the pod runs:
//
//   - the pod holds a bootstrap certificate (stor://csi-node-bootstrap/…,
//     shared by every node plugin pod) that authz.go admits to this one
//     call and nothing else (the Raft and data ports refuse its role at
//     the handshake), and a projected ServiceAccount token with audience
//     TokenAudience, which kubelet binds to the pod and so to its node;
//   - it makes a key that never leaves the node and sends a CSR for it
//     with the token;
//   - the server that receives the call (any server: issuing is not Raft
//     state, and the call is never forwarded) asks the Kubernetes
//     TokenReview API about the token, for TokenAudience. It issues only
//     when the token authenticates, the review's audiences include
//     TokenAudience (the API server checked the audience), its user is
//     NodeCertConfig.ServiceAccount, and the review's user extra
//     NodeNameExtra names exactly one node (Kubernetes 1.32 and later set
//     it for pod-bound tokens). The node is taken from the review only:
//     nothing in the request names it, so a pod can only ever get a
//     certificate for the node kubelet says it runs on. A csi-node
//     certificate may call again to renew, for its own node only;
//   - it signs the CSR's key as stor://csi-node/<node> (client
//     authentication only, NodeCertConfig.Validity, a random serial) with
//     the issuing CA, which must be one the servers' CA bundle trusts,
//     checks the result chains to this server's bundle, audit-logs the
//     issuance and returns the chain and the bundle.

// TokenAudience is the audience a node plugin's ServiceAccount token must
// be issued for (the projected volume's audience) and the TokenReview asks
// about.
const TokenAudience = "stor"

// NodeNameExtra is the TokenReview user extra naming the node of the pod a
// token is bound to.
const NodeNameExtra = "authentication.kubernetes.io/node-name"

// podNameExtra names the pod, for the audit log.
const podNameExtra = "authentication.kubernetes.io/pod-name"

// DefaultNodeServiceAccount is NodeCertConfig.ServiceAccount's default:
// deploy/'s node plugin ServiceAccount.
const DefaultNodeServiceAccount = "system:serviceaccount:stor-system:stor-csi-node"

// maxTokenBytes and maxCSRBytes bound what a caller may make this server
// send to the Kubernetes API or parse.
const (
	maxTokenBytes = 16 << 10
	maxCSRBytes   = 16 << 10
)

// tokenReviewTimeout bounds one TokenReview.
const tokenReviewTimeout = 10 * time.Second

// NodeCertConfig configures IssueNodeCertificate.
type NodeCertConfig struct {
	// IssuerCert and IssuerKey are the PEM files of the CA that signs node
	// certificates (re-read at each issuance, so a rotated CA is used at
	// once). The servers' CA bundle must trust it: the simplest is the
	// cluster CA itself. Both empty (the default): this server issues no
	// node certificates, and the call answers FailedPrecondition.
	IssuerCert, IssuerKey string
	// ServiceAccount is the Kubernetes user a token must authenticate as.
	// Default DefaultNodeServiceAccount.
	ServiceAccount string
	// Validity of an issued certificate. Default 24h.
	Validity time.Duration
	// Kubeconfig is the kubeconfig file of the Kubernetes API that reviews
	// tokens. Default "": the in-cluster configuration (the pod's
	// ServiceAccount, which needs create on tokenreviews).
	Kubeconfig string
	// Reviewer reviews tokens. Default: the TokenReview API of Kubeconfig
	// (NewKubeTokenReviewer); tests pass a fake.
	Reviewer TokenReviewer
}

// Enabled reports whether an issuing CA is configured.
func (c NodeCertConfig) Enabled() bool { return c.IssuerCert != "" || c.IssuerKey != "" }

// TokenReviewer authenticates a Kubernetes ServiceAccount token for
// TokenAudience (authentication.k8s.io/v1 TokenReview).
type TokenReviewer interface {
	// Review asks about token; an error means the API could not be asked
	// (a token that does not authenticate is a review, not an error).
	Review(ctx context.Context, token string) (TokenReview, error)
}

// TokenReview is what the Kubernetes API said about a token (a
// TokenReviewStatus).
type TokenReview struct {
	Authenticated bool
	// Error is the API's reason for not authenticating.
	Error    string
	Username string
	// Audiences are those of the review's that the token is valid for.
	Audiences []string
	Extra     map[string][]string
}

// Errors of node certificates (codeTable).
var (
	// ErrNoNodeIssuer: this server was started without an issuing CA.
	ErrNoNodeIssuer = errors.New("server: this server issues no node certificates (start it with --node-issuer-cert and --node-issuer-key)")
	// ErrTokenReview: the Kubernetes API could not review a token.
	ErrTokenReview = errors.New("server: token review failed")
)

func (c *NodeCertConfig) withDefaults() {
	if c.ServiceAccount == "" {
		c.ServiceAccount = DefaultNodeServiceAccount
	}
	if c.Validity == 0 {
		c.Validity = 24 * time.Hour
	}
}

// validate checks the issuing CA loads and that tls (the server's
// certificates) trusts it.
func (c *NodeCertConfig) validate(tls *pki.Source) error {
	if !c.Enabled() {
		return nil
	}
	switch {
	case c.IssuerCert == "" || c.IssuerKey == "":
		return fmt.Errorf("server: --node-issuer-cert and --node-issuer-key are both needed")
	case tls == nil:
		return fmt.Errorf("server: node certificates need TLS (--tls-cert, --tls-key, --tls-ca)")
	case c.Validity < 0:
		return fmt.Errorf("server: node certificate validity %v must be positive", c.Validity)
	}
	iss, err := pki.LoadIssuer(c.IssuerCert, c.IssuerKey)
	if err != nil {
		return fmt.Errorf("server: --node-issuer-cert: %w", err)
	}
	if err := trusted(tls, iss.Cert, iss.Chain, x509.ExtKeyUsageAny); err != nil {
		return fmt.Errorf("server: --node-issuer-cert %q is not trusted by --tls-ca: %w", iss.Cert.Subject.CommonName, err)
	}
	return nil
}

// trusted checks that cert chains (through inter) to tls's CA bundle.
func trusted(tls *pki.Source, cert *x509.Certificate, inter []*x509.Certificate, usage x509.ExtKeyUsage) error {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(tls.CABundle()) {
		return fmt.Errorf("the CA bundle holds no certificate")
	}
	ip := x509.NewCertPool()
	for _, c := range inter {
		ip.AddCert(c)
	}
	_, err := cert.Verify(x509.VerifyOptions{Roots: roots, Intermediates: ip, KeyUsages: []x509.ExtKeyUsage{usage}})
	return err
}

// issueNodeCertificate is IssueNodeCertificate; see the comment at the top.
func (s *Server) issueNodeCertificate(ctx context.Context, req *storpb.IssueNodeCertificateRequest) (*storpb.IssueNodeCertificateResponse, error) {
	cfg := s.cfg.NodeCerts
	if !cfg.Enabled() {
		return nil, ErrNoNodeIssuer
	}
	who, _ := callerOf(ctx)
	refuse := func(err error) error {
		s.logger.Warn("node certificate refused", "identity", who.String(), "err", err)
		return err
	}
	switch {
	case req.Token == "":
		return nil, refuse(fmt.Errorf("%w: no ServiceAccount token", ErrUnauthenticated))
	case len(req.Token) > maxTokenBytes:
		return nil, refuse(fmt.Errorf("%w: the token is longer than %d bytes", ErrUnauthenticated, maxTokenBytes))
	case len(req.Csr) > maxCSRBytes:
		return nil, refuse(fmt.Errorf("%w: longer than %d bytes", pki.ErrCSR, maxCSRBytes))
	}
	rctx, cancel := context.WithTimeout(ctx, tokenReviewTimeout)
	defer cancel()
	review, err := cfg.Reviewer.Review(rctx, req.Token)
	if err != nil {
		return nil, refuse(fmt.Errorf("%w: %v", ErrTokenReview, err))
	}
	node, err := nodeOfReview(review, cfg.ServiceAccount)
	if err != nil {
		return nil, refuse(err)
	}
	if who.Role == pki.RoleCSINode && who.Name != node {
		return nil, refuse(fmt.Errorf("%w: %s may renew only its own certificate, not node %q's", ErrPermissionDenied, who, node))
	}
	iss, err := pki.LoadIssuer(cfg.IssuerCert, cfg.IssuerKey)
	if err != nil {
		return nil, refuse(err)
	}
	id := pki.Identity{Role: pki.RoleCSINode, Name: node}
	chain, err := iss.SignCSR(req.Csr, id, time.Now(), cfg.Validity)
	if err != nil {
		return nil, refuse(err)
	}
	leaf, inter, err := parseChain(chain)
	if err != nil {
		return nil, refuse(fmt.Errorf("%w: %v", pki.ErrIssuer, err))
	}
	if err := trusted(s.cfg.TLS, leaf, inter, x509.ExtKeyUsageClientAuth); err != nil {
		return nil, refuse(fmt.Errorf("%w: the certificate it signed is not trusted by this server's CA bundle (--node-issuer-cert must be a CA --tls-ca holds): %v", pki.ErrIssuer, err))
	}
	s.logger.Info("audit", "event", "node certificate issued", "identity", who.String(), "node", node,
		"certificate", id.String(), "serial", leaf.SerialNumber.Text(16), "not_after", leaf.NotAfter,
		"service_account", review.Username, "pod", firstExtra(review, podNameExtra))
	return &storpb.IssueNodeCertificateResponse{CertificateChain: chain, CaBundle: s.cfg.TLS.CABundle(), Node: node}, nil
}

// nodeOfReview returns the node a review binds its token to, if the token
// authenticates as serviceAccount for TokenAudience.
func nodeOfReview(r TokenReview, serviceAccount string) (string, error) {
	switch {
	case !r.Authenticated:
		return "", fmt.Errorf("%w: the token does not authenticate: %s", ErrUnauthenticated, r.Error)
	case !slices.Contains(r.Audiences, TokenAudience):
		return "", fmt.Errorf("%w: the token is not for audience %q (its audiences here: %q)", ErrUnauthenticated, TokenAudience, r.Audiences)
	case r.Username != serviceAccount:
		return "", fmt.Errorf("%w: the token is %q's, not the node plugin's %q", ErrPermissionDenied, r.Username, serviceAccount)
	}
	nodes := r.Extra[NodeNameExtra]
	if len(nodes) != 1 {
		return "", fmt.Errorf("%w: the token names %d nodes in %s, want 1 (a pod-bound projected token, Kubernetes 1.32 or later)", ErrPermissionDenied, len(nodes), NodeNameExtra)
	}
	if err := (pki.Identity{Role: pki.RoleCSINode, Name: nodes[0]}).Validate(); err != nil {
		return "", fmt.Errorf("%w: node name from the token review: %v", ErrPermissionDenied, err)
	}
	return nodes[0], nil
}

func firstExtra(r TokenReview, key string) string {
	if v := r.Extra[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// parseChain reads a PEM chain: the leaf, then intermediates.
func parseChain(chain []byte) (*x509.Certificate, []*x509.Certificate, error) {
	var certs []*x509.Certificate
	for rest := chain; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, nil, err
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, nil, fmt.Errorf("no certificate")
	}
	return certs[0], certs[1:], nil
}
