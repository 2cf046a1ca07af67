package csi

import (
	"context"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A token is what encode made for its listing, and nothing else is one.
func TestListTokenRoundTrip(t *testing.T) {
	for _, tok := range []listToken{
		{kind: listSnapshots, after: "a"},
		{kind: listVolumes, cluster: "djE6YWJj", after: "0f8e-\x00-id"},
		{kind: listHealth, cluster: string(make([]byte, 300)), after: "z"},
		{kind: listSnapshots, filter: "3:vol", cluster: "djE6YWJj", after: "s"},
	} {
		got, err := decodeListToken(tok.kind, tok.filter, tok.encode())
		if err != nil || got != tok {
			t.Errorf("decode(encode(%+v)) = %+v, %v", tok, got, err)
		}
		for _, other := range []byte{listSnapshots, listVolumes, listHealth} {
			if _, err := decodeListToken(other, tok.filter, tok.encode()); other != tok.kind && status.Code(toStatus(err)) != codes.Aborted {
				t.Errorf("a %c token decoded as a %c one: %v", tok.kind, other, err)
			}
		}
	}
	for _, s := range []string{"invalid-token", "0", "c3Rvci1jc2ktbGlzdDE", listToken{kind: listVolumes, cluster: "x"}.encode()} {
		if _, err := decodeListToken(listVolumes, "", s); status.Code(toStatus(err)) != codes.Aborted {
			t.Errorf("token %q: %v, want Aborted", s, err)
		}
	}
}

// A token whose cluster page token the cluster refuses (a forged one, or
// one from a cluster restored from elsewhere) is ABORTED, not the
// cluster's INVALID_ARGUMENT: the CO starts its listing again. A cluster
// listing out of id order is INTERNAL: the pages would be wrong.
func TestListClusterTokenRefusedAndOrder(t *testing.T) {
	ctrl, f := newFakeListingController(t, 5, 20)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	forged := listToken{kind: listSnapshots, cluster: "not-a-cluster-token", after: f.snaps[3].Id}.encode()
	if _, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: forged}); status.Code(toStatus(err)) != codes.Aborted {
		t.Errorf("ListSnapshots from a token with a forged cluster token: %v, want Aborted", err)
	}
	f.mu.Lock()
	f.snaps[4], f.snaps[5] = f.snaps[5], f.snaps[4]
	f.mu.Unlock()
	if _, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{}); status.Code(toStatus(err)) != codes.Internal {
		t.Errorf("ListSnapshots of a cluster listing out of order: %v, want Internal", err)
	}
}
