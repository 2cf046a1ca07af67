// Package pki is stor's mutual TLS: the tls.Config of every listener and
// every client, the identity each certificate carries, and a generator of
// a local CA and role certificates (make cluster, tests).
//
// # Identities
//
// Every certificate names exactly one identity in a URI SAN:
//
//	stor://<role>/<name>
//
// with role one of server, csi-controller, csi-node, operator or
// csi-node-bootstrap, and name the server id, the Kubernetes node name, or
// any label for the others. A csi-node-bootstrap certificate may only ask
// for a csi-node certificate (see Node certificates).
// A URI SAN rather than O=role, CN=name: the subject is free text that CAs
// and tools rewrite, and a CN is ignored for verification by Go since 1.15;
// a URI SAN is a typed field that cert-manager sets directly (spec.uris),
// that SPIFFE uses for the same purpose, and that cannot be confused with a
// DNS name. A certificate with no stor:// URI, or with more than one, has
// no identity and is refused.
//
// # Verification
//
// Both sides use TLS 1.3 only and verify the peer's chain against the CA
// bundle themselves (VerifyConnection), not Go's host-name check: stor
// peers are dialled by whatever address Raft or the metadata holds (an IP,
// a pod DNS name, a proxy in tests), and what a peer must prove is its
// role, not a host name. So a client checks that the server presents a
// chain to the CA with ExtKeyUsageServerAuth and the role server; a server
// requires a client certificate with a chain to the CA, ExtKeyUsageClientAuth
// and one of the roles the listener admits (the Raft port: server only).
// An expired certificate, a certificate of another CA, or none at all fail
// the handshake.
//
// # Who is calling
//
// PeerOf gives a gRPC method the identity of its caller; on a Listener's
// connections (each a *tls.Conn, its handshake done on the first read)
// ConnIdentity completes the handshake and gives the peer's. Both return
// ErrNoPeer on a plaintext connection.
//
// # Rotation
//
// A Source re-reads its three files (certificate, key, CA bundle) when
// their size or modification time changes, checked at most every
// ReloadInterval, at the next handshake (GetCertificate,
// GetClientCertificate and VerifyConnection all read the current set). A
// reload that fails — a half-written pair, a key that does not match — keeps
// the previous set and logs. Connections already established keep the
// certificate they were made with.
//
// # Node certificates
//
// A DaemonSet's pods cannot be given certificates naming each one's node
// by a template (cert-manager has no such field), so a node plugin obtains
// its own, as kubelet TLS bootstrap does: it makes a key, sends a CSR
// with its pod's ServiceAccount token over a connection authenticated by
// the shared csi-node-bootstrap certificate, and a server that has the
// token reviewed by Kubernetes signs the CSR's key (Issuer.SignCSR) as
// stor://csi-node/<the node Kubernetes binds the token to>. SignCSR uses
// only the request's key (after checking the request is signed with it):
// the identity is the caller's decision, never the requester's. Its
// certificates are for client authentication only, short-lived, and
// start a little before now for clock skew. The server side is package
// server (nodecert.go), the node side package nodecert.
//
// # Insecure
//
// Without certificates a binary runs only with an explicit --insecure, and
// CheckLoopback refuses every address that is not on loopback, so an
// unauthenticated port is never reachable from the network.
package pki
