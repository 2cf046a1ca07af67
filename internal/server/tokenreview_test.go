package server_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"testing"

	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/client-go/rest"

	"github.com/stor-io/stor/internal/server"
)

// The Kubernetes reviewer POSTs an authentication.k8s.io/v1 TokenReview
// for audience "stor" with the token, and reads back the status: user,
// audiences and extras (the node name).
func TestKubeTokenReviewerSpeaksTokenReview(t *testing.T) {
	var got authnv1.TokenReview
	var path, auth string
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		path, auth = r.Method+" "+r.URL.Path, r.Header.Get("Authorization")
		body, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(body, &got); err != nil {
			t.Errorf("request body %q: %v", body, err)
		}
		resp := got
		resp.Status = authnv1.TokenReviewStatus{
			Authenticated: true,
			User: authnv1.UserInfo{
				Username: "system:serviceaccount:stor-system:stor-csi-node",
				Extra:    map[string]authnv1.ExtraValue{server.NodeNameExtra: {"worker-1"}},
			},
			Audiences: []string{"stor"},
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(resp)
	}))
	defer api.Close()
	rv, err := server.NewKubeTokenReviewerFor(&rest.Config{Host: api.URL, BearerToken: "server-sa-token"})
	if err != nil {
		t.Fatal(err)
	}
	review, err := rv.Review(context.Background(), "pod-token")
	if err != nil {
		t.Fatal(err)
	}
	if path != "POST /apis/authentication.k8s.io/v1/tokenreviews" || auth != "Bearer server-sa-token" {
		t.Errorf("request %q with %q, want POST /apis/authentication.k8s.io/v1/tokenreviews as the server's account", path, auth)
	}
	if got.Spec.Token != "pod-token" || !reflect.DeepEqual(got.Spec.Audiences, []string{server.TokenAudience}) {
		t.Errorf("review spec %+v, want the pod's token for audience %q", got.Spec, server.TokenAudience)
	}
	want := server.TokenReview{
		Authenticated: true, Username: "system:serviceaccount:stor-system:stor-csi-node",
		Audiences: []string{"stor"}, Extra: map[string][]string{server.NodeNameExtra: {"worker-1"}},
	}
	if !reflect.DeepEqual(review, want) {
		t.Errorf("review %+v, want %+v", review, want)
	}
}
