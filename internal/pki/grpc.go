package pki

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// GRPCServerCredentials is the ServerOption of a control API that admits
// every role; what each may call is decided per method from PeerOf.
func (s *Source) GRPCServerCredentials() grpc.ServerOption {
	return grpc.Creds(credentials.NewTLS(s.ServerConfig()))
}

// GRPCDialCredentials is the DialOption of a client of the control API
// (which must present a server certificate).
func (s *Source) GRPCDialCredentials() grpc.DialOption {
	return grpc.WithTransportCredentials(credentials.NewTLS(s.ClientConfig(RoleServer)))
}

// PeerOf is the identity of the caller of a gRPC method served with
// GRPCServerCredentials; ErrNoPeer on a plaintext server.
func PeerOf(ctx context.Context) (Identity, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Identity{}, ErrNoPeer
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return Identity{}, ErrNoPeer
	}
	return PeerIdentity(info.State)
}
