package server

import (
	"context"
	"fmt"

	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// kubeReviewer is the TokenReviewer of a Kubernetes API server. It is a
// REST client of the one resource it needs (authentication.k8s.io/v1
// tokenreviews) with a scheme of that group only: the typed clientset would
// register every API group and nearly triple stor-server's size.
type kubeReviewer struct {
	rc *rest.RESTClient
}

// NewKubeTokenReviewer returns a TokenReviewer asking the TokenReview API
// of the cluster kubeconfig names, or with "" of the cluster this process
// runs in (its pod's ServiceAccount). Its user needs the RBAC verb create
// on tokenreviews.authentication.k8s.io (system:auth-delegator has it).
func NewKubeTokenReviewer(kubeconfig string) (TokenReviewer, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("server: the Kubernetes API that reviews node plugin tokens: %w", err)
	}
	return NewKubeTokenReviewerFor(cfg)
}

// NewKubeTokenReviewerFor is NewKubeTokenReviewer for the API server and
// credentials of cfg.
func NewKubeTokenReviewerFor(cfg *rest.Config) (TokenReviewer, error) {
	scheme := runtime.NewScheme()
	if err := authnv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	c.APIPath = "/apis"
	c.GroupVersion = &authnv1.SchemeGroupVersion
	c.ContentType = runtime.ContentTypeJSON
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = "stor-server"
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("server: Kubernetes client: %w", err)
	}
	return kubeReviewer{rc: rc}, nil
}

func (k kubeReviewer) Review(ctx context.Context, token string) (TokenReview, error) {
	r := &authnv1.TokenReview{}
	err := k.rc.Post().Resource("tokenreviews").Body(&authnv1.TokenReview{
		Spec: authnv1.TokenReviewSpec{Token: token, Audiences: []string{TokenAudience}},
	}).Do(ctx).Into(r)
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
