package csi

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// sanityFront is one CSI socket in front of the controller and the node
// plugin when they run as two processes (STOR_CSI_TLS_DIR), for
// csi-sanity: its node tests ask the node socket's Identity whether the
// plugin has a controller service, and call ControllerPublish only if it
// says so (a node plugin alone says no, and then cannot stage: a csi-node
// certificate attaches only what a publish attached to it). The front
// forwards /csi.v1.Controller/* to the controller and everything else to
// the node plugin, unchanged, except GetPluginCapabilities, which answers
// with both processes' capabilities — what the two processes are
// together, as a cluster's sidecars see them.
func sanityFront(t *testing.T, e *external) string {
	t.Helper()
	node, ctrl := dialCSI(t, e.endpoint), dialCSI(t, e.ctrlEndpoint)
	sock := filepath.Join(e.dir, "front.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(stream)
		var req []byte
		if err := stream.RecvMsg(&req); err != nil {
			return err
		}
		ctx := stream.Context()
		if md, ok := metadata.FromIncomingContext(ctx); ok {
			ctx = metadata.NewOutgoingContext(ctx, md)
		}
		if method == csipb.Identity_GetPluginCapabilities_FullMethodName {
			resp, err := mergedCapabilities(ctx, node, ctrl)
			if err != nil {
				return err
			}
			return stream.SendMsg(&resp)
		}
		to := node
		if strings.HasPrefix(method, "/csi.v1.Controller/") {
			to = ctrl
		}
		var resp []byte
		if err := to.Invoke(ctx, method, &req, &resp, grpc.ForceCodec(rawCodec{})); err != nil {
			return err // its status, unchanged
		}
		return stream.SendMsg(&resp)
	}))
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return "unix://" + sock
}

// mergedCapabilities is the union of both processes' plugin capabilities,
// marshalled.
func mergedCapabilities(ctx context.Context, conns ...*grpc.ClientConn) ([]byte, error) {
	out := &csipb.GetPluginCapabilitiesResponse{}
	seen := map[string]bool{}
	for _, c := range conns {
		r, err := csipb.NewIdentityClient(c).GetPluginCapabilities(ctx, &csipb.GetPluginCapabilitiesRequest{})
		if err != nil {
			return nil, err
		}
		for _, pc := range r.GetCapabilities() {
			if k := pc.String(); !seen[k] {
				seen[k] = true
				out.Capabilities = append(out.Capabilities, pc)
			}
		}
	}
	return proto.Marshal(out)
}

// rawCodec passes messages through as bytes.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }
