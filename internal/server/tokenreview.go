package server

import (
	"context"
	"fmt"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authnclient "k8s.io/client-go/kubernetes/typed/authentication/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// kubeReviewer is the TokenReviewer of a Kubernetes API server.
type kubeReviewer struct {
	reviews authnclient.TokenReviewInterface
}

// NewKubeTokenReviewer returns a TokenReviewer asking the TokenReview API
// of the cluster kubeconfig names, or with "" of the cluster this process
// runs in (its pod's ServiceAccount, which needs the RBAC verb create on
// tokenreviews.authentication.k8s.io).
func NewKubeTokenReviewer(kubeconfig string) (TokenReviewer, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("server: the Kubernetes API that reviews node plugin tokens (in-cluster, or --kubeconfig): %w", err)
	}
	c, err := authnclient.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("server: Kubernetes client: %w", err)
	}
	return kubeReviewer{reviews: c.TokenReviews()}, nil
}

func (k kubeReviewer) Review(ctx context.Context, token string) (TokenReview, error) {
	r, err := k.reviews.Create(ctx, &authnv1.TokenReview{
		Spec: authnv1.TokenReviewSpec{Token: token, Audiences: []string{TokenAudience}},
	}, metav1.CreateOptions{})
	if err != nil {
		return TokenReview{}, err
	}
	extra := make(map[string][]string, len(r.Status.User.Extra))
	for key, v := range r.Status.User.Extra {
		extra[key] = []string(v)
	}
	return TokenReview{
		Authenticated: r.Status.Authenticated,
		Error:         r.Status.Error,
		Username:      r.Status.User.Username,
		Audiences:     r.Status.Audiences,
		Extra:         extra,
	}, nil
}
