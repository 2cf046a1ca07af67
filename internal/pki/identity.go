package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"regexp"
)

// Role is what an identity is allowed to be; see Identity.
type Role string

// The roles of stor's certificates.
const (
	RoleServer        Role = "server"         // a stor-server; Name is its --id
	RoleCSIController Role = "csi-controller" // stor-csi --mode=controller
	RoleCSINode       Role = "csi-node"       // stor-csi --mode=node; Name is the Kubernetes node
	RoleOperator      Role = "operator"       // stor-ctl
	// RoleCSINodeBootstrap may only ask for a csi-node certificate
	// (ClusterService.IssueNodeCertificate); Name is any label. One such
	// certificate is shared by every node plugin pod.
	RoleCSINodeBootstrap Role = "csi-node-bootstrap"
)

// Roles lists every role.
var Roles = []Role{RoleServer, RoleCSIController, RoleCSINode, RoleOperator, RoleCSINodeBootstrap}

// Valid reports whether r is one of Roles.
func (r Role) Valid() bool {
	for _, v := range Roles {
		if r == v {
			return true
		}
	}
	return false
}

// Identity is the authenticated name of a peer: its role and its name.
type Identity struct {
	Role Role
	Name string
}

// Scheme is the URI scheme of an identity SAN.
const Scheme = "stor"

// namePattern matches server ids and Kubernetes node names (DNS subdomains).
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$`)

// Validate reports whether the identity can be put in a certificate.
func (i Identity) Validate() error {
	if !i.Role.Valid() {
		return fmt.Errorf("%w: unknown role %q", ErrIdentity, i.Role)
	}
	if !namePattern.MatchString(i.Name) {
		return fmt.Errorf("%w: name %q: use 1-253 letters, digits, '.', '_' or '-'", ErrIdentity, i.Name)
	}
	return nil
}

// URI is the identity's SAN, stor://role/name.
func (i Identity) URI() *url.URL {
	return &url.URL{Scheme: Scheme, Host: string(i.Role), Path: "/" + i.Name}
}

func (i Identity) String() string { return i.URI().String() }

// ParseIdentity reads a stor://role/name URI.
func ParseIdentity(u *url.URL) (Identity, error) {
	if u.Scheme != Scheme || u.User != nil || u.RawQuery != "" || u.Fragment != "" || len(u.Path) < 2 {
		return Identity{}, fmt.Errorf("%w: %q is not stor://role/name", ErrIdentity, u.String())
	}
	id := Identity{Role: Role(u.Host), Name: u.Path[1:]}
	if err := id.Validate(); err != nil {
		return Identity{}, err
	}
	return id, nil
}

// IdentityOf returns the identity in cert's URI SANs: exactly one stor://
// URI must be present. It does not verify the certificate.
func IdentityOf(cert *x509.Certificate) (Identity, error) {
	var found []Identity
	for _, u := range cert.URIs {
		if u.Scheme != Scheme {
			continue
		}
		id, err := ParseIdentity(u)
		if err != nil {
			return Identity{}, err
		}
		found = append(found, id)
	}
	switch len(found) {
	case 0:
		return Identity{}, fmt.Errorf("%w: certificate %q has no stor:// URI", ErrIdentity, cert.Subject.CommonName)
	case 1:
		return found[0], nil
	default:
		return Identity{}, fmt.Errorf("%w: certificate %q has %d stor:// URIs", ErrIdentity, cert.Subject.CommonName, len(found))
	}
}

// Sentinel errors.
var (
	// ErrIdentity: a certificate names no valid identity.
	ErrIdentity = errors.New("pki: no valid identity")
	// ErrRole: the peer's role is not admitted here.
	ErrRole = errors.New("pki: role not admitted")
	// ErrNotLoopback: --insecure with an address off loopback.
	ErrNotLoopback = errors.New("pki: --insecure needs loopback addresses")
	// ErrNoPeer: a connection or context carries no verified certificate.
	ErrNoPeer = errors.New("pki: no verified peer")
	// ErrCSR: a certificate request is malformed, not signed by its key,
	// or for a key too weak (Issuer.SignCSR).
	ErrCSR = errors.New("pki: bad certificate request")
	// ErrIssuer: an issuing CA's files are not a usable CA, or it has
	// expired.
	ErrIssuer = errors.New("pki: unusable issuing CA")
)
